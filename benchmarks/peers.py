"""spill against its peers on one model, one memory cap, the same token ids, greedy (issue 12).

    python benchmarks/peers.py [--size 1b] [--cap 1GiB] [--batches 1,16,64] [--spill-rows 256]

In one run on one machine: builds (or reuses) a factory llama under --models and its GGUF; measures
the cold read bandwidth; then each run is a child process in a fresh child memory cgroup (v1 or v2,
under this process's own) with --cap bytes, page cache charged, the model's files dropped from the
cache first: spill through `spill run` (--spill-rows rows; its budget picks the batch), llama.cpp
(mmap, no repacking), transformers + accelerate (disk offload) and mlx-lm (resident) at each batch.
A run that is OOM-killed or passes --timeout is a result too. The cold read is measured again at the
end. Writes one JSON line per run to --json and the table into docs/benchmarks.md (peers markers).
"""

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))   # last: tests.machine; an installed spill wins
from pass_time import drop_cache, model_args, model_folder, read_all  # noqa: E402
from peers_report import child_stages, table, text_agreement, write_doc  # noqa: E402

from tests.machine import ChildCgroup  # noqa: E402
from spill.coordinator import history  # noqa: E402
from spill.memory import parse_size  # noqa: E402
from spill.platform import preload_env  # noqa: E402

HERE = Path(__file__).resolve().parent
PEERS = ("spill", "llama.cpp", "accelerate", "mlx-lm")
OVER_CAP = 5   # peers_child's exit code for a peer whose GPU memory passed --gpu-cap


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_args(p, "1b")
    p.add_argument("--cap", default="1GiB", help="the child cgroup's memory limit (below the model's size)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--new", type=int, default=32, help="tokens generated per row")
    p.add_argument("--batches", default="1,16,64", help="the peers' batches")
    p.add_argument("--spill-rows", type=int, default=256, help="rows given to spill run (its budget picks the batch)")
    p.add_argument("--spill-cap", default="", help="also run spill at this cap (e.g. one its budget admits rows at)")
    p.add_argument("--spill-budget-fraction", type=float, default=None, help="spill's --budget-fraction (its "
                   "guard and hard lines rise above it)")
    p.add_argument("--gpu-cap", default="", help="GPU memory each peer may hold where a GPU is (default: --cap)")
    p.add_argument("--cgroup-parent", default="", help="make the capped cgroups under this one (cgroup v2 where "
                   "this process's own cannot have children with a memory controller)")
    p.add_argument("--marker", default="peers", help="the docs markers the table goes between (e.g. peers-gpu)")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--mlx-batches", default="1", help="mlx-lm's batches (it is expected to die at load)")
    p.add_argument("--hf-batches", default="", help="accelerate's batches (default: --batches)")
    p.add_argument("--hf-gpu-share", default="0.5", help="shares of the GPU cap accelerate fills with weights "
                   "(the rest holds its KV and activations), e.g. 0.25,0.5: each runs at every batch")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one peer's run may take")
    p.add_argument("--spill-timeout", type=float, default=900.0, help="seconds spill's run may take (prefill included)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--work", default="/tmp/spill-peers", help="scratch: inputs, spill's data home, offload")
    p.add_argument("--json", default="", help="JSON lines file (default: WORK/results.jsonl)")
    p.add_argument("--doc", default=str(HERE.parent / "docs" / "benchmarks.md"), help="'' to skip writing it")
    p.add_argument("--table", default="", help="only print (and write) the table of this results file")
    return p.parse_args()


# -- the prompts: text that spill's tokenizer turns into exactly --prompt ids ------------------------------------
WORDS = ("return value index table stream layer weight batch token memory read write cache pass row "
         "model prompt file disk budget queue worker result error time block shard buffer").split()


def prompts(folder: Path, rows: int, length: int) -> tuple[list[str], list[list[int]]]:
    import random
    from spill.tokenizer_worker.core import TokenizerCore
    tok = TokenizerCore(folder).tokenizer
    rng, texts, ids = random.Random(0), [], []
    while len(texts) < rows:
        words = " ".join(rng.choice(WORDS) for _ in range(length))
        cut = tok.encode(f"row {len(texts)}: {words}")[:length]
        text = tok.decode(cut, skip_special_tokens=True)
        if len(cut) == length and tok.encode(text) == cut:   # the text round-trips to the same ids
            texts.append(text)
            ids.append(cut)
    return texts, ids


# -- a child memory cgroup with the cap ------------------------------------------------------------------------------
def run_in(cg: ChildCgroup, cmd: list, timeout: float, env: dict) -> tuple[int | None, str, str, float]:
    """(exit code or None on timeout, stdout, stderr, seconds) of `cmd` started inside the cgroup."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cg.command(cmd), stdout=out, stderr=err, env=env, text=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            cg.kill_all()
            proc.wait()
        out.seek(0), err.seek(0)
        return rc, out.read(), err.read(), time.monotonic() - t0


def capped(a, name: str, cmd: list, env: dict, files, cap: str = "", timeout: float = 0) -> dict:
    """Run `cmd` in a fresh cgroup of `cap` (--cap) bytes; status ok / oom-killed / timeout / failed, with the facts."""
    drop_cache(files)
    try:
        cg = ChildCgroup(f"spill-peers-{os.getpid()}-{name}", parse_size(cap or a.cap), a.cgroup_parent or None)
    except OSError as err:
        raise SystemExit(f"cannot make a child memory cgroup here ({err}); run as root on Linux")
    try:
        with GpuWatch() as gpu:
            rc, out, err, wall = run_in(cg, cmd, timeout or a.timeout, env)
        kills, peak = cg.oom_kills(), cg.peak()
    finally:
        cg.remove()
    status = "ok" if rc == 0 else "timeout" if rc is None else "oom-killed" if kills else "failed"
    return {"status": status, "rc": rc, "oom_kills": kills, "cgroup_peak": peak, "wall_s": round(wall, 1),
            "stdout": out, **({"gpu_used_peak": gpu.peak, "gpu_samples": gpu.samples} if gpu.peak is not None else {}),
            **child_stages(err)}


def peak_within(samples: list, passes: list) -> int | None:
    """The GPU's memory in use at its most while spill's passes ran (from the first's start to the last's end),
    apart from the run's start (the group's processes and the first-use probe, which has a CUDA context of its own)."""
    if not samples or not passes:
        return None
    start, end = passes[0]["time"] - passes[0]["seconds"], passes[-1]["time"]
    inside = [u for t, u in samples if start <= t <= end]
    return max(inside) if inside else None


class GpuWatch:
    """The GPU's memory in use (nvidia-smi: every process's, CUDA contexts and allocators' caches included) at its
    most while a child runs, above what was in use before it started; `peak` None where no GPU answers. `samples`:
    (wall-clock time, bytes above that) every 0.2 s, so a phase of the run (spill's passes) has its own peak."""

    def __enter__(self) -> "GpuWatch":
        self.peak, self.samples, self._base, self._done = None, [], gpu_used(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True) if self._base is not None else None
        if self._thread:
            self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            self.samples.append((time.time(), (gpu_used() or self._base) - self._base))
        self.samples.append((time.time(), (gpu_used() or self._base) - self._base))
        self.peak = max(0, *(u for _, u in self.samples))

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread:
            self._thread.join()


def gpu_used() -> int | None:
    """Bytes in use on the first GPU, or None where nvidia-smi does not answer."""
    if not gpu_name():
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
        return int(out.stdout.split()[0]) << 20 if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


# -- the peers ---------------------------------------------------------------------------------------------------------
def run_peer(a, peer: str, batch: int, spec: dict, files) -> dict:
    spec = {**spec, "prompts": spec["prompts"][:batch]}
    path = Path(a.work) / f"spec-{peer}-{batch}-{spec.get('hf_gpu_share', '')}.json"
    path.write_text(json.dumps(spec))
    r = capped(a, f"{peer}-{batch}", [sys.executable, HERE / "peers_child.py", peer, path], dict(os.environ), files)
    r.pop("gpu_samples", None)
    out = r.pop("stdout").strip().splitlines()
    if r["status"] == "failed" and r["rc"] == OVER_CAP:
        r["status"] = "over the GPU cap"
    if r["status"] == "ok":
        r.update(json.loads(out[-1]))
    else:   # what it got done before it died
        steps = [s for s in r["stages"] if s["stage"] == "step"]
        pre = next((s for s in r["stages"] if s["stage"] == "prefilled"), None)
        over = next((s for s in r["stages"] if s["stage"] == "over-cap"), None)
        if over:
            r["gpu_peak"] = over["gpu_peak"]
        if pre:
            r.update(prefill_s=pre["seconds"], tokens=[pre["token"]] + [s["token"] for s in steps])
        r["steps"] = [s["seconds"] for s in steps]
    steps = r.get("steps") or []
    if steps:
        r["s_per_step"] = statistics.median(steps)
        r["decode_tps"] = batch * len(steps) / sum(steps)
    r.pop("stages")
    if spec.get("hf_gpu_share") is not None and r.get("gpu_share") is None and "devices" not in r:
        r["gpu_share"] = spec["hf_gpu_share"]   # a child that died before it reported the share it ran with
    return {"peer": peer, "batch": batch, **r}


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
    """spill's batch, passes, and decode step and tok/s over its full-batch decode passes (a job's history)."""
    decode = [p for p in passes if p["prefill_tokens"] == 0 and p["decode_rows"] > 0]
    r = {"batch": max((p["decode_rows"] for p in passes), default=0), "passes": len(passes)}
    if decode:
        full = [p for p in decode if p["decode_rows"] == r["batch"]] or decode
        r["s_per_step"] = statistics.median(p["seconds"] for p in full)
        # as each peer's: its batch over its mean step; and over every decode pass, a wave's tail included
        r["decode_tps"] = r["batch"] * len(full) / sum(p["seconds"] for p in full)
        r["decode_tps_all"] = sum(p["emitted"] for p in decode) / sum(p["seconds"] for p in decode)
        r["bytes_per_pass"] = full[0]["bytes_streamed"]
    return r


def run_spill(a, folder: Path, texts: list[str], files, cap: str = "") -> dict:
    work = Path(a.work) / f"spill-{cap or a.cap}"   # a data home and output per run: an earlier run's would be
    shutil.rmtree(work, ignore_errors=True)         # read as this one's where this one fails
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    inp = work / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": t, "max_tokens": a.new}) + "\n"
                           for i, t in enumerate(texts)))
    env = {**os.environ, "SPILL_HOME": str(home), "SPILL_METRICS_PORT": "0"}
    cmd = [sys.executable, "-m", "spill.coordinator.cli", "run", folder, inp, "-o", work / "out.jsonl", "--new",
           "--quiet"]
    if gpu_name():   # the GPU cap every peer gets is spill's working set there; the cgroup caps the host's memory
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
        shutil.copy(jobs[-1], Path(a.work) / f"passes-spill-{cap or a.cap}.jsonl")
    r.update(decode_figures(passes))
    within = peak_within(r.pop("gpu_samples", []), passes)
    if within is not None:
        r["gpu_used_passes"] = within
    if passes and gpu_name():
        r["gpu_peak"] = max(p["peak_memory"] for p in passes)   # MLX's arrays live on the GPU there
        if r["gpu_peak"] > parse_size(a.gpu_cap or cap or a.cap):   # the peers' rule holds for spill too
            r["status"] = "over the GPU cap"
    if (work / "out.jsonl").exists():
        rows = [json.loads(x) for x in (work / "out.jsonl").read_text().splitlines() if x.strip()]
        done = [x for x in rows if x.get("error") is None]
        r["rows_ok"], r["rows_error"] = len(done), len(rows) - len(done)
        r["completion_tokens"] = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in done)
        r["text0"] = next((x["response"]["body"]["choices"][0]["text"] for x in done if x["custom_id"] == "r0"), None)
        if rows and rows[0].get("error"):
            r["first_error"] = rows[0]["error"].get("message", str(rows[0]["error"]))[:300]
    r.update(budget_log(home / "run" / "logs" / "admission.log"))
    return {"peer": "spill", "rows": len(texts), **({"cap": parse_size(cap)} if cap else {}), **r}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in ("streamweights", "mlx", "mlx-lm", "llama-cpp-python", "transformers", "accelerate", "torch", "gguf"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def machine() -> str:
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), "?")
    mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    gpu, core = gpu_name(), blas()
    return (f"{os.cpu_count()} x {cpu}, {mem / 2**30:.0f} GiB RAM" + (f", OpenBLAS's {core} kernels" if core else "")
            + (f", {gpu}" if gpu else ""))


def blas() -> str:
    """The OpenBLAS kernels spill's processes run: a child's, with OpenBLAS preloaded as spill preloads it."""
    code = "from tests.machine import blas_core; print(blas_core())"
    done = subprocess.run([sys.executable, "-c", code], env=preload_env(), capture_output=True, text=True, timeout=60,
                          cwd=HERE.parent)
    return done.stdout.strip()


@functools.cache
def gpu_name() -> str:
    """The NVIDIA GPU's name where nvidia-smi answers, else '' (asked once)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def agree_with_text(folder: Path, results: list[dict]) -> None:
    """Row 0 of each spill run against accelerate's greedy tokens, through spill's own tokenizer's decode."""
    ref = next((r.get("tokens") for r in results if r.get("peer") == "accelerate" and r.get("tokens")), None)
    spills = [r for r in results if r.get("peer") == "spill" and r.get("text0") is not None]
    if ref and spills:
        from spill.tokenizer_worker.core import TokenizerCore
        tok = TokenizerCore(folder).tokenizer
        for r in spills:
            r["agree"] = text_agreement(r["text0"], ref, lambda ids: tok.decode(ids, skip_special_tokens=True))


def main() -> None:
    a = parse()
    if a.table:
        lines = table([json.loads(x) for x in Path(a.table).read_text().splitlines()])
        print("\n".join(lines))
        return write_doc(Path(a.doc), lines, a.marker) if a.doc else None
    from peers_gguf import convert
    Path(a.work).mkdir(parents=True, exist_ok=True)
    out = Path(a.json or Path(a.work) / "results.jsonl")
    folder = model_folder(a)
    shards = sorted(folder.glob("*.safetensors"))
    gguf = Path(a.models) / f"{folder.name}.gguf"
    wanted = a.peers.split(",")
    if "llama.cpp" in wanted and not gguf.exists():
        print(f"converting {folder} to {gguf} ...", flush=True)
        convert(folder, gguf)
    size = sum(f.stat().st_size for f in shards)
    if parse_size(a.cap) >= size:
        print(f"note: the cap {a.cap} is not below the model's {size / 2**30:.2f} GiB", flush=True)
    texts, ids = prompts(folder, max(a.spill_rows, *map(int, a.batches.split(","))), a.prompt)
    files = shards + ([gguf] if gguf.exists() else [])
    head = {"run": "peers", "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "cap": parse_size(a.cap), "model": folder.name, "model_bytes": size, "prompt": a.prompt, "new": a.new,
            "cold_gbps_before": read_all(shards)}
    gpu_cap = parse_size(a.gpu_cap or a.cap) if gpu_name() else None
    if gpu_cap:
        head["gpu_cap"] = gpu_cap
    results = [head]
    out.write_text(json.dumps(head) + "\n")
    print(f"model {size / 1e9:.2f} GB, cap {a.cap}, cold read {head['cold_gbps_before']:.2f} GB/s", flush=True)
    spec = {"model": str(folder), "gguf": str(gguf), "prompts": ids, "new": a.new, "threads": a.threads,
            "offload": str(Path(a.work) / "offload"), "gpu_cap": gpu_cap,
            "hf_dtype": a.dtype if gpu_cap else "float32"}   # computed as spill computes: stored on a GPU, f32 on a CPU
    plan = [("spill", a.spill_rows, "", "")] if "spill" in wanted else []   # (peer, batch, spill's cap, accelerate's share)
    for peer in ("mlx-lm", "accelerate", "llama.cpp"):
        if peer in wanted:
            batches = {"mlx-lm": a.mlx_batches, "accelerate": a.hf_batches}.get(peer) or a.batches
            shares = a.hf_gpu_share.split(",") if peer == "accelerate" and gpu_cap else [""]
            plan += [(peer, b, "", share) for share in shares for b in map(int, batches.split(","))]
    if a.spill_cap and "spill" in wanted:
        at = next((i for i, step in enumerate(plan) if step[0] == "llama.cpp"), len(plan))
        plan.insert(at, ("spill", a.spill_rows, a.spill_cap, ""))
    for peer, b, cap, share in plan:
        print(f"{peer} at batch {b}{f' under {cap}' if cap else ''} ...", flush=True)
        r = run_spill(a, folder, texts[:b], files, cap) if peer == "spill" else run_peer(
            a, peer, b, {**spec, **({"hf_gpu_share": float(share)} if share else {})}, files)
        results.append(r)
        with open(out, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"  {r['status']}: " + (f"{r['s_per_step']:.2f} s/step, {r['decode_tps']:.1f} tok/s at batch {r['batch']}"
                                      if "decode_tps" in r else f"after {r['wall_s']} s ({r.get('last_stage')})"), flush=True)
    agree_with_text(folder, results)
    results.append({"run": "peers-end", "cold_gbps_after": read_all(shards), "versions": versions()})
    tmp = out.with_suffix(".tmp")   # the lines again, spill's with their agreement, then the tail
    tmp.write_text("".join(json.dumps(r) + "\n" for r in results))
    tmp.replace(out)
    lines = table(results)
    print("\n".join(lines))
    print(f"results: {out}")
    if a.doc:
        write_doc(Path(a.doc), lines, a.marker)


if __name__ == "__main__":
    main()
