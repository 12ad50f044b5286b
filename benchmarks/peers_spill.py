"""spill's runs in peers.py: `spill run` through the front door in a capped cgroup, once per configuration of
extra arguments, and its figures from the job's pass history and admission's log."""

import json
import os
import shlex
import shutil
import statistics
import sys
from pathlib import Path

from peers_run import capped, gpu_name, peak_within
from spill.coordinator import history
from spill.memory import parse_size


def spill_configs(args: str, configs: str) -> list[list[str]]:
    """Each spill run's extra `spill run` arguments: `--spill-args` for every run, then one run per `;`-separated
    entry of `--spill-configs` (`off` is short for `--speculate off`), or one run with `--spill-args` alone."""
    common = shlex.split(args)
    entries = [c.strip() for c in configs.split(";")] if configs.strip() else [""]
    return [common + (["--speculate", "off"] if c == "off" else shlex.split(c)) for c in entries]


def kv_label(args: list[str]) -> str:
    """The KV cache a spill run keeps, from its arguments: `8-bit (group 32)`, or the computed dtype's."""
    if "--kv-bits" not in args:
        return "compute dtype"
    bits = args[args.index("--kv-bits") + 1]
    group = args[args.index("--kv-group-size") + 1] if "--kv-group-size" in args else "default"
    return f"{bits}-bit (group {group})"


def budget_log(path: Path) -> dict:
    """What admission priced (its `budget` line, and its last `allowance` line: the prompt tokens a pass may
    carry, chosen from the job's rows) and the most slots its decode pools held (its `pass` lines)."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")] if path.exists() else []
    out = {}
    for event in ("budget", "allowance"):
        last = [x for x in lines if x.get("event") == event][-1:]
        if last:
            out[event] = {k: v for k, v in last[0].items() if k not in ("actor", "pid", "level", "timestamp", "event")}
    slots = [sum(n for n, _ in x["pools"]) for x in lines if x.get("event") == "pass" and x.get("pools")]
    if slots:
        out["pool_slots"] = max(slots)
    return out


def decode_figures(passes: list[dict]) -> dict:
    """spill's batch, passes, and decode step and tok/s over its full-batch decode passes (a job's history); the
    tokens a pass emitted count accepted drafts, so with drafts a step gives more than the batch."""
    decode = [p for p in passes if p["prefill_tokens"] == 0 and p["decode_rows"] > 0]
    # the batch is the widest decode pass: with drafts the widest pass may take prompts, and rows move on unevenly
    widest = max((p["decode_rows"] for p in passes), default=0)
    r = {"batch": max((p["decode_rows"] for p in decode), default=widest), "widest": widest, "passes": len(passes)}
    if decode:
        full = [p for p in decode if p["decode_rows"] == r["batch"]]
        r["s_per_step"] = statistics.median(p["seconds"] for p in full)
        # as each peer's: tokens over its steps at its batch; and over every decode pass, a wave's tail included
        r["decode_tps"] = sum(p["emitted"] for p in full) / sum(p["seconds"] for p in full)
        r["decode_tps_all"] = sum(p["emitted"] for p in decode) / sum(p["seconds"] for p in decode)
        r["decode_tokens"], r["decode_s"] = sum(p["emitted"] for p in decode), sum(p["seconds"] for p in decode)
        r["bytes_per_pass"] = full[0]["bytes_streamed"]
    r["drafted"] = sum(n for p in passes for _, n in p.get("drafted") or [])
    r["accepted"] = sum(n for p in passes for _, n in p.get("accepted") or [])
    return r


def outputs(path: Path) -> dict:
    """Rows done and failed, the tokens generated, and row 0's text (a chat row's message or a completion's)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    done = [x for x in rows if x.get("error") is None]
    r = {"rows_ok": len(done), "rows_error": len(rows) - len(done),
         "completion_tokens": sum(x["response"]["body"]["usage"]["completion_tokens"] for x in done)}
    first = next((x["response"]["body"]["choices"][0] for x in done if x["custom_id"] == "r0"), None)
    r["text0"] = None if first is None else first["text"] if "text" in first else first["message"]["content"]
    if rows and rows[0].get("error"):
        r["first_error"] = rows[0]["error"].get("message", str(rows[0]["error"]))[:300]
    return r


def run_spill(a, folder: Path, lines: list[dict], files, cap: str = "", args: list[str] = (), n: int = 0) -> dict:
    """`spill run` of `lines` with `args` added, in a cgroup of `cap` (--cap); run n of this peers run."""
    name = f"{cap or a.cap}-{n}"
    work = Path(a.work) / f"spill-{name}"   # a data home and output per run: an earlier run's would be
    shutil.rmtree(work, ignore_errors=True)   # read as this one's where this one fails
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    inp = work / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    env = {**os.environ, "SPILL_HOME": str(home), "SPILL_METRICS_PORT": "0"}
    cmd = [sys.executable, "-m", "spill.coordinator.cli", "run", folder, inp, "-o", work / "out.jsonl", "--new",
           "--quiet", *args]
    if gpu_name() and "--memory" not in args:   # the GPU cap every peer gets is spill's working set there
        cmd += ["--memory", str(parse_size(a.gpu_cap or cap or a.cap))]
    if a.spill_budget_fraction:
        cmd += ["--budget-fraction", str(a.spill_budget_fraction)]
    r = capped(a, "spill", cmd, env, files, cap, a.spill_timeout)
    r["stdout_tail"] = r.pop("stdout").strip().splitlines()[-4:]
    r.pop("stages")
    if r["status"] == "failed" and r["rc"] == 3:
        r["status"] = "ok, some rows failed"
    jobs = sorted((home / "jobs").glob("*/passes.jsonl"), key=lambda p: p.stat().st_mtime)
    passes = history.read(jobs[-1].parent) if jobs else []
    if jobs:   # every pass's memory and timings, beside the results (the job's folder goes with the machine)
        shutil.copy(jobs[-1], Path(a.work) / f"passes-spill-{name}.jsonl")
    r.update(decode_figures(passes))
    within = peak_within(r.pop("gpu_samples", []), passes)
    if within is not None:
        r["gpu_used_passes"] = within
    if passes and gpu_name():
        r["gpu_peak"] = max(p["peak_memory"] for p in passes)   # MLX's arrays live on the GPU there
        if r["gpu_peak"] > parse_size(a.gpu_cap or cap or a.cap):   # the peers' rule holds for spill too
            r["status"] = "over the GPU cap"
    if (work / "out.jsonl").exists():
        r.update(outputs(work / "out.jsonl"))
    r.update(budget_log(home / "run" / "logs" / "admission.log"))
    return {"peer": "spill", "rows": len(lines), **({"cap": parse_size(cap)} if cap else {}),
            "args": " ".join(args), "kv": kv_label(list(args)), **r}
