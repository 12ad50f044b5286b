"""The three-tier job end to end, as a user runs it, in a child memory cgroup smaller than the model
(issue 7's job section): the pre-run estimate against the measured total, the live ETA's error at
25/50/75% of the job, the long tier's pass time over the short tier's at equal batch, the total over
the ideal, rows per hour and finishing time per tier, and the job's `spill report` plot.

    python benchmarks/job.py [--size lean45] [--rows 200] [--max-tokens 128] [--limit 1.25GiB] [--dtype float32]
                             [--fresh] [--warmup 24] [--pair-batch 8] [--kv-bits 8|4] [--speculate off] [--figures JOB]

1. builds a factory model (`lean45` in float32: 2.55 GiB, twice the default 1.25 GiB cgroup) and the
   three-tier input (`three_tier.py`, token counts from the model's tokenizer); with --warmup, runs a
   short job of every tier first (the calibration refits from its passes, as after a user's first job);
2. runs `spill run MODEL INPUT` inside a child cgroup of --limit bytes (no --memory: spill finds the
   limit), in its own data home (--fresh: a new one, so the estimate starts from the first-use probes);
3. runs two small jobs at one batch (--pair-batch rows of the longest and of the shortest tier, 48 new
   tokens each) in the same cgroup, for the tiers' decode pass times at equal batch;
4. reads the job's job.json and passes.jsonl, prints the figures as JSON (with the reads' rate in the
   warm-up's passes and in the job's, and the pre-run estimate again at the job's rate, from the
   calibration copied before it), and draws the plot with `spill report`.
Root is needed for the cgroup (v1, under this process's own) and to drop the page cache.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))   # last: tests.machine; an installed spill wins
import three_tier  # noqa: E402
from tests.machine import ChildCgroup  # noqa: E402
from pass_time import drop_cache, model_args, model_folder  # noqa: E402

QUANTILES = (0.25, 0.5, 0.75)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_args(p, "lean45")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=three_tier.MAX_TOKENS)
    p.add_argument("--limit", default="1.25GiB", help="the child cgroup's memory limit (the working set): the "
                   "group's processes hold ~0.75 GiB before any KV on lean45, so less leaves long rows no room")
    p.add_argument("--warmup", type=int, default=0, help="rows of a short job on the same model first, so the "
                   "job's estimate starts from a refitted calibration as a user's second job does (0: none)")
    p.add_argument("--home", default="/tmp/spill-bench-home", help="the runs' SPILL_HOME")
    p.add_argument("--fresh", action="store_true", help="start from an empty data home (first-use calibration)")
    p.add_argument("--budget-fraction", type=float, default=None, help="spill's --budget-fraction for every run "
                   "(default: spill's own)")
    p.add_argument("--kv-bits", type=int, choices=(8, 4), help="spill's --kv-bits for every run (default: unquantized)")
    p.add_argument("--kv-group-size", type=int, default=64, help="spill's --kv-group-size with --kv-bits")
    p.add_argument("--speculate", help="spill's --speculate for every run (default: spill's, auto)")
    p.add_argument("--pair-batch", type=int, default=8, help="rows of each tier's pair run (0: none)")
    p.add_argument("--figures", metavar="JOB", help="no runs: the figures of JOB, a job this script ran before in "
                   "--home with its input in --out")
    p.add_argument("--out", type=Path, default=Path("/tmp/spill-job-bench"))
    p.set_defaults(dtype="float32")   # stored as computed on a CPU: bytes, not conversions, fill the pass
    return p.parse_args()


def spill_in_cgroup(args: list, limit: int, env: dict, log: Path) -> str:
    """Run `spill ARGS` inside a new child cgroup; return the job id it printed."""
    cg = ChildCgroup(f"spill-job-{os.getpid()}-{time.monotonic_ns()}", limit)
    try:
        with open(log, "w") as f:
            proc = subprocess.run(cg.command([sys.executable, "-m", "spill.coordinator.cli", *args]),
                                  stdout=f, stderr=subprocess.STDOUT, env=env)
        oom, peak = cg.oom_kills() > 0, cg.peak()
    finally:
        cg.remove()   # the group's last processes may still be exiting
    text = log.read_text()
    if proc.returncode or oom:
        raise SystemExit(f"spill {' '.join(map(str, args[:1]))} exited {proc.returncode}"
                         f"{' (OOM-killed)' if oom else ''}; its output:\n{text[-3000:]}")
    print(f"  cgroup peak {peak / 2**20:.0f} MiB", flush=True)
    return re.search(r"job (\S+): \d+ rows", text).group(1)


def job_files(home: Path, job: str) -> tuple[dict, list[dict]]:
    from spill.coordinator import history
    d = home / "jobs" / job
    return json.loads((d / "job.json").read_text()), history.read(d)


def eta_errors(passes: list[dict], total: int) -> dict:
    """At the first pass where q of the rows are done: the live ETA over the time that was actually left."""
    end, out = passes[-1]["time"], {}
    for q in QUANTILES:
        p = next((p for p in passes if p["done"] >= q * total and p.get("eta_s") is not None), None)
        if p is not None and end > p["time"]:
            out[f"{int(q * 100)}%"] = {"eta_s": round(p["eta_s"], 1), "left_s": round(end - p["time"], 1),
                                       "eta_over_actual": round(p["eta_s"] / (end - p["time"]), 3)}
    return out


def tiers(rows: list[dict], passes: list[dict]) -> dict:
    """Per tier (the custom_id's prefix): rows, rows per hour of the job, and when its last row finished."""
    start, end = passes[0]["time"] - passes[0]["seconds"], passes[-1]["time"]
    names = [r["custom_id"].rsplit("-", 1)[0] for r in rows]
    last: dict[str, float] = {}
    for p in passes:
        for row in p.get("finished_rows", []):
            last[names[row]] = p["time"]
    hours = (end - start) / 3600
    return {t: {"rows": names.count(t), "rows_per_hour": round(names.count(t) / hours, 1),
                "last_row_at": round((last[t] - start) / (end - start), 3) if t in last else None}
            for t in dict.fromkeys(names)}


def decode_pass_s(passes: list[dict], batch: int) -> float | None:
    """The median decode-only pass at `batch` rows (no prompt prefilled in it)."""
    s = [p["seconds"] for p in passes if p["decode_rows"] == batch and p["prefill_tokens"] == 0]
    return statistics.median(s) if s else None


def ideal(folder: Path, rows: list[dict], out_rows: dict, limit: str, fraction: float | None, kv: tuple | None) -> float:
    """The ideal with this run's refitted pass model: per tier, rows x output tokens / the largest batch the
    budget fits, times the roofline pass (admission/simulate.py's `_ideal`), summed."""
    from spill.admission.simulate import SimRow
    from spill.coordinator.estimate import estimate_rows, remembered_others
    sim = []
    for i, r in enumerate(rows):
        usage = out_rows[r["custom_id"]]["response"]["body"]["usage"]
        sim.append(SimRow(i, usage["prompt_tokens"], max(usage["completion_tokens"], 1)))
    est, _ = estimate_rows(folder, sim, memory=limit, fraction=fraction, others=remembered_others() or 0, kv=kv)
    return est.ideal_seconds


def read_rate(passes: list[dict]) -> float | None:
    """Bytes/s of the reads inside the passes (the reader's own seconds), as the calibration takes it."""
    from spill.admission.passmodel import read_rate as rate
    return rate(((p["bytes_streamed"], p.get("read_s"), p["compute_s"]) for p in passes), least=1 << 28)


def estimate_at(folder: Path, rows: list[dict], out_rows: dict, limit: str, fraction: float | None,
                before: Path, bandwidth: float, kv: tuple | None) -> float:
    """The pre-run estimate again, from the calibration as it was before the job (`before`), with its reads
    at `bandwidth`: what the estimate would have said of a disk running as it did in the job."""
    from dataclasses import replace
    from spill.admission.passmodel import Observation, PassModel, fit
    from spill.admission.simulate import SimRow
    from spill.coordinator.estimate import estimate_rows, remembered_others
    data = json.loads(before.read_text())
    passes, sample = ([Observation(**p) for p in data.get(k, [])] for k in ("passes", "sample"))
    model = replace(fit(PassModel(**data["prior"]), passes, sample), bandwidth=bandwidth)
    sim = [SimRow(i, out_rows[r["custom_id"]]["response"]["body"]["usage"]["prompt_tokens"], r["body"]["max_tokens"])
           for i, r in enumerate(rows)]
    est, _ = estimate_rows(folder, sim, memory=limit, fraction=fraction, others=remembered_others() or 0, model=model,
                           kv=kv)
    return est.total_seconds


def main() -> None:
    a = parse()
    from spill.memory import format_size, parse_size
    limit = parse_size(a.limit)
    a.out.mkdir(parents=True, exist_ok=True)
    for old in a.out.glob("*out.jsonl") if not a.figures else ():   # each run writes its outputs anew
        old.unlink()
    home = Path(a.home)
    if a.fresh and home.exists() and not a.figures:
        shutil.rmtree(home)
    env = {**os.environ, "SPILL_HOME": str(home)}
    extra = ["--budget-fraction", str(a.budget_fraction)] if a.budget_fraction else []
    extra += ["--kv-bits", str(a.kv_bits), "--kv-group-size", str(a.kv_group_size)] if a.kv_bits else []
    extra += ["--speculate", a.speculate] if a.speculate else []
    os.environ["SPILL_HOME"] = str(home)
    folder = model_folder(a)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"model {folder}: {format_size(size)} on disk; cgroup limit {format_size(limit)} "
          f"({size / limit:.1f}x smaller than the model)", flush=True)
    inp = a.out / "three-tier.jsonl"
    if a.figures:   # a job run before: its figures alone
        rows = [json.loads(line) for line in open(inp)]
        return report(a, folder, size, limit, rows, home, env, extra, a.figures, None, None)
    rows = three_tier.make_rows(a.rows, three_tier.counter(str(folder)))
    for r in rows:
        r["body"]["max_tokens"] = a.max_tokens
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))

    warm = None
    if a.warmup:
        few = rows[:: max(len(rows) // a.warmup, 1)][:a.warmup]
        path = a.out / "warmup.jsonl"
        path.write_text("".join(json.dumps(dict(r, body={**r["body"], "max_tokens": 16})) + "\n" for r in few))
        drop_cache(sorted(folder.glob("*.safetensors")))
        print(f"0. a warm-up job: {len(few)} rows of every tier, max_tokens 16", flush=True)
        wj = spill_in_cgroup(["run", folder, path, "-o", a.out / "warmup.out.jsonl", "--quiet", "--new", *extra], limit, env,
                             a.out / "warmup.log")
        wm = job_files(home, wj)[0]
        warm = {"job": wj, "rows": len(few), "estimate_s": (wm.get("estimate") or {}).get("total_seconds"),
                "actual_s": (wm.get("summary") or {}).get("actual_seconds"),
                "read_gbps": round((read_rate(job_files(home, wj)[1]) or 0) / 1e9, 3)}
    drop_cache(sorted(folder.glob("*.safetensors")))
    for f in (home / "calibration").glob("*.json"):   # the calibration the estimate starts from
        shutil.copy(f, a.out / f"before-{f.name}")
    print(f"1. the job: {len(rows)} rows, max_tokens {a.max_tokens}", flush=True)
    t0 = time.time()
    job = spill_in_cgroup(["run", folder, inp, "-o", a.out / "out.jsonl", "--quiet", "--new", *extra], limit, env,
                          a.out / "job.log")
    report(a, folder, size, limit, rows, home, env, extra, job, time.time() - t0, warm)


def report(a, folder: Path, size: int, limit: int, rows: list[dict], home: Path, env: dict, extra: list, job: str,
           wall: float | None, warm: dict | None) -> None:
    """The job's figures into result.json (then the tier pairs' unless --pair-batch is 0), and its plot."""
    meta, passes = job_files(home, job)
    out_rows = {json.loads(line)["custom_id"]: json.loads(line) for line in open(a.out / "out.jsonl")}

    summary = meta.get("summary") or {}
    estimate = (meta.get("estimate") or {}).get("total_seconds")
    actual = summary.get("actual_seconds")
    kv = (a.kv_bits, a.kv_group_size) if a.kv_bits else None
    ideal_s = ideal(folder, rows, out_rows, a.limit, a.budget_fraction, kv)
    result = {
        "model": str(folder), "model_bytes": size, "limit": limit, "kv": summary.get("kv"), "rows": len(rows),
        "max_tokens": a.max_tokens,
        "budget_fraction": a.budget_fraction, "job": job, "wall_s": wall and round(wall, 1), "passes": len(passes),
        "estimate_s": estimate, "actual_s": actual, "actual_over_estimate": summary.get("actual_over_estimate"),
        "eta": eta_errors(passes, meta.get("total") or len(rows)),
        "ideal_s": round(ideal_s, 1), "actual_over_ideal": round(actual / ideal_s, 3) if actual and ideal_s else None,
        "tiers": tiers(rows, passes), "peak_live": max(p["active_memory"] + p.get("cache_memory", 0) for p in passes),
        "estimate_ideal_s": (meta.get("estimate") or {}).get("ideal_seconds"), "warmup": warm,
        "read_gbps": {"warmup": warm and warm.get("read_gbps"), "job": round((read_rate(passes) or 0) / 1e9, 3)},
    }
    before = [f for f in a.out.glob("before-*.json") if f.name != "before-group.json"]
    if before and read_rate(passes):
        at = estimate_at(folder, rows, out_rows, a.limit, a.budget_fraction, before[0], read_rate(passes), kv)
        result["estimate_at_job_read_s"] = round(at, 1)
        result["actual_over_estimate_at_job_read"] = round(actual / at, 3) if actual else None
    png = subprocess.run([sys.executable, "-m", "spill.coordinator.cli", "report", job, "-o", str(a.out / "job.png")],
                         capture_output=True, text=True, env=env)
    result["plot"] = png.stdout.strip() or png.stderr.strip()
    (a.out / "result.json").write_text(json.dumps(result, indent=1))   # the job's figures, before the pairs
    if a.pair_batch:
        result.update(tier_pairs(a, folder, rows, limit, env, home, extra))
        (a.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def tier_pairs(a, folder: Path, rows: list[dict], limit: int, env: dict, home: Path, extra: list) -> dict:
    """The longest and the shortest tier's decode pass time at one batch (--pair-batch rows each)."""
    print(f"2. the tiers at batch {a.pair_batch}", flush=True)
    pair = {}
    for tier in (three_tier.TIERS[-1][0], three_tier.TIERS[0][0]):
        # 48 new tokens: every row still decodes when the last long prompt has prefilled
        few = [dict(r, body={**r["body"], "max_tokens": 48}) for r in rows if r["custom_id"].startswith(tier)]
        path = a.out / f"{tier}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in few[:a.pair_batch]))
        pj = spill_in_cgroup(["run", folder, path, "-o", a.out / f"{tier}.out.jsonl", "--quiet", "--new", *extra], limit,
                             {**env, "SPILL_MAX_ROWS": str(a.pair_batch)}, a.out / f"{tier}.log")
        pair[tier] = decode_pass_s(job_files(home, pj)[1], a.pair_batch)

    long, short = three_tier.TIERS[-1][0], three_tier.TIERS[0][0]
    return {"tier_pass_s": pair, "long_over_short": round(pair[long] / pair[short], 3) if all(pair.values()) else None}


if __name__ == "__main__":
    main()
