"""A pipeline against one rank at the same cap a rank: the same job through `spill run` on a group of 1, 2 and 3
ranks on this machine, each rank in its own child memory cgroup of --cap bytes and on --cores-per-rank cores of
its own (as N machines of that size would be), the single rank holding the whole model under one such cap.

    python benchmarks/ranks.py [--size tall] [--ranks 1,2,3] [--cap 1GiB] [--cores-per-rank 1] [--rows 96]
                               [--max-tokens 32] [--micro-batches 0] [--repeat 1] [--rounds 1,8]
    python benchmarks/ranks.py --dtype bfloat16 --up-args="--memory 3GiB" ...   (a GPU: its memory by --memory)
    python benchmarks/ranks.py --gpu-per-rank ...   (several GPUs: a rank on each, as machines of one GPU each)
    python benchmarks/ranks.py --cap 4GiB --replicas 1,0 ...   (a cap the model fits: replicas, then a pipeline)

1. builds a factory model (float32, as a CPU computes) and a job of short questions (kv_bits.py's);
2. per rank count, starts `spill up` on every rank as `mlx.launch` would (MLX_RANK, MLX_HOSTFILE on loopback), each
   inside its cgroup and pinned to its cores, then `spill run` joins rank 0's group (no --memory: spill finds its
   cap), and `spill down` ends it;
3. prints per run, from the job's passes.jsonl: the running rows of a pass, decode tokens/s, the median pass,
   the advisor's choice (resident or streamed), each cgroup's peak and OOM kills, rank 0's share of its decode
   passes blocked on its neighbours (`link_s`: the bubble as rank 0 sees it), the seconds of a decode step (a pass of
   R rounds: its seconds / R), and every custom_id once; then each count's tokens/s over one rank's. --rounds runs a
   pipeline once for each SPILL_ROUNDS given (1: one decode step a pass), --replicas once for each SPILL_REPLICAS.
Root is needed for the cgroups (v1 or v2, under this process's own) and to drop the page cache.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))   # last: tests.machine; an installed spill wins
import three_tier  # noqa: E402
from job import job_files  # noqa: E402
from kv_bits import figures, job_rows  # noqa: E402
from pass_time import drop_cache, model_args, model_folder  # noqa: E402
from tests.machine import ChildCgroup  # noqa: E402

SPILL = [sys.executable, "-m", "spill.coordinator.cli"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_args(p, "tall")
    p.add_argument("--ranks", default="1,2,3")
    p.add_argument("--cap", default="1GiB", help="each rank's child cgroup limit (below the model's size)")
    p.add_argument("--cores-per-rank", type=int, default=1)
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=None, help="spill up's --micro-batches (default: its own)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each rank count, interleaved")
    p.add_argument("--rounds", default="", help="SPILL_ROUNDS values, a run of each rank count past 1 for each "
                   "(comma-separated; default the group's own)")
    p.add_argument("--replicas", default="", help="SPILL_REPLICAS values, a run of each rank count past 1 for each "
                   "(1,0: replicas where each rank holds the model, then a pipeline; default the advisor's own)")
    p.add_argument("--data", type=Path, default=three_tier.DATA, help="the folder of gsm8k_test.jsonl")
    p.add_argument("--out", type=Path, default=Path("/tmp/spill-ranks-bench"))
    p.add_argument("--up-args", default="", help="more arguments for every rank's `spill up` (a GPU's --memory)")
    p.add_argument("--first-use-under-cap", action="store_true", help="no calibration beforehand: the first job "
                   "calibrates the model itself, under rank 0's cap")
    p.add_argument("--gpu-per-rank", action="store_true", help="rank r on GPU r alone (CUDA_VISIBLE_DEVICES), as N "
                   "machines of one GPU each would be")
    p.add_argument("--cgroup-parent", default="", help="make the cgroups under this one (cgroup v2 where its "
                   "processes moved to a leaf), not under this process's own")
    p.set_defaults(dtype="float32")
    return p.parse_args()


def spill(args: list, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*SPILL, *map(str, args)], env=env, capture_output=True, text=True, **kw)


def up(n: int, a, env: dict, work: Path) -> tuple[list, list]:
    """`spill up` on n ranks, rank r in its own cgroup on cores [r*k, (r+1)*k); (the cgroups, the processes) once
    rank 0's group answers with every stage."""
    from spill.memory import parse_size
    from spill.stages.launch import hostfile
    k, cap = a.cores_per_rank, parse_size(a.cap)
    if n * k > os.cpu_count():
        raise SystemExit(f"{n} ranks of {k} cores need {n * k} cores; this machine has {os.cpu_count()}")
    hosts = hostfile(n, work) if n > 1 else None
    extra = a.up_args.split() + ([] if a.micro_batches is None or n == 1 else ["--micro-batches", a.micro_batches])
    groups, procs = [], []
    for r in range(n):
        cg = ChildCgroup(f"spill-rank{r}-{os.getpid()}-{time.monotonic_ns()}", cap, a.cgroup_parent or None)
        groups.append(cg)
        ring = {"MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)} if hosts else {}
        cores = set(range(r * k, (r + 1) * k))
        log = open(work / f"rank{r}.log", "w")
        gpu = {"CUDA_VISIBLE_DEVICES": str(r)} if a.gpu_per_rank else {}
        procs.append(subprocess.Popen(cg.command([*SPILL, "up", *extra]),
                                      env={**env, **ring, **gpu, "OPENBLAS_NUM_THREADS": str(k)},
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      preexec_fn=lambda c=cores: os.sched_setaffinity(0, c)))
    deadline = time.monotonic() + 300
    while True:
        status = spill(["status"], env).stdout
        if status.startswith("group:") and sum(line.startswith("stage ") for line in status.splitlines()) >= (n > 1) * n:
            return groups, procs
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            down(groups, procs, env)
            raise SystemExit(f"the group of {n} ranks did not come up:\n" +
                             "\n".join((work / f"rank{r}.log").read_text()[-1500:] for r in range(n)))
        time.sleep(0.5)


def down(groups: list, procs: list, env: dict) -> list[dict]:
    """`spill down`, every rank's process ended; each cgroup's peak and OOM kills, the cgroups removed."""
    spill(["down"], env, timeout=120)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
    facts = []
    for cg in groups:
        facts.append({"peak_mib": round(cg.peak() / 2**20), "oom_kills": cg.oom_kills()})
        for _ in range(50):   # the group's last processes may still be exiting
            try:
                cg.remove()
                break
            except OSError:
                time.sleep(0.2)
    return facts


def one(n: int, a, folder: Path, inp: Path, ids: list[str], env: dict, rounds: str = "", replicas: str = "") -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"spill-ranks{n}-", dir=a.out))
    drop_cache(sorted(folder.glob("*.safetensors")))
    env = {**env, **({"SPILL_ROUNDS": rounds} if rounds else {}), **({"SPILL_REPLICAS": replicas} if replicas else {})}
    groups, procs = up(n, a, env, work)
    try:
        out = work / "out.jsonl"
        t0 = time.time()
        run = spill(["run", folder, inp, "-o", out, "--new"], env)
        wall = time.time() - t0
    finally:
        cgroups = down(groups, procs, env)
    if run.returncode:
        raise SystemExit(f"spill run on {n} ranks exited {run.returncode}:\n{(run.stdout + run.stderr)[-3000:]}")
    job = re.search(r"job (\S+): \d+ rows", run.stdout).group(1)
    meta, passes = job_files(Path(env["SPILL_HOME"]), job)
    advice = (meta.get("estimate") or {}).get("advice") or ""
    (work / "run.log").write_text(run.stdout + run.stderr)
    decoding = [p for p in passes[2:] if p["decode_rows"] and p["seconds"]]   # past the first passes' fill
    steps = [p["seconds"] / p.get("rounds", 1) for p in passes if p["emitted"] and not p["prefill_tokens"]]
    blocked = sum(p.get("link_s", 0.0) for p in decoding) / max(sum(p["seconds"] for p in decoding), 1e-9)
    # rank 0's decode pass, median of each part: where a streamed stage's pass goes (its read, waiting on it, math)
    parts = {k: round(statistics.median(p.get(k, 0.0) for p in decoding), 3) if decoding else None
             for k in ("read_s", "wait_s", "compute_s", "link_s")}
    parts["read_mb"] = round(statistics.median(p["bytes_streamed"] for p in decoding) / 1e6) if decoding else None
    return {"ranks": n, "job": job, "wall_s": round(wall, 1), "mode": advice.split(":")[0].split(" (")[0] or None,
            "cgroups": cgroups, "rank0_blocked_share": round(blocked, 3) if n > 1 else None, "rounds": rounds or None,
            "round_s_median": round(statistics.median(steps), 4) if steps else None,
            "prompt_passes_s": round(sum(p["seconds"] for p in passes if p["prefill_tokens"]), 2),
            "rank0_decode_pass": parts, "estimate_s": (meta.get("estimate") or {}).get("total_seconds"),
            "took_over_estimate": float(m.group(1)) if (m := re.search(r"against an estimate of .*\(([\d.]+)x\)",
                                                                       run.stdout)) else None,
            **figures(passes, out, ids)}


def main() -> None:
    a = parse()
    from spill.memory import parse_size
    a.out.mkdir(parents=True, exist_ok=True)
    home = a.out / "home"
    env = {**os.environ, "SPILL_HOME": str(home), "SPILL_METRICS_PORT": "0"}
    os.environ["SPILL_HOME"] = str(home)
    folder = model_folder(a)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    rows = job_rows(a.rows, a.max_tokens, three_tier.counter(str(folder)), a.data)
    inp = a.out / "questions.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ids = [r["custom_id"] for r in rows]
    counts = [int(n) for n in a.ranks.split(",")]
    print(f"model {folder} ({size / 2**30:.2f} GiB); {len(rows)} rows, max_tokens {a.max_tokens}; each rank: cgroup "
          f"{a.cap}, {a.cores_per_rank} core(s); {os.cpu_count()} cores here", flush=True)
    if parse_size(a.cap) >= size:
        print(f"note: the cap ({a.cap}) is not below the model's size", flush=True)
    # the first-use calibration once, on one rank's cores but outside the caps: every run shares the data home, so
    # every rank count starts from the same one
    k = a.cores_per_rank
    if not a.first_use_under_cap:
        spill(["estimate", folder, inp], {**env, "OPENBLAS_NUM_THREADS": str(k)}, timeout=900,
              preexec_fn=lambda: os.sched_setaffinity(0, set(range(k))))
    runs = []
    for _ in range(a.repeat):
        for n in counts:
            for rounds in (a.rounds.split(",") if a.rounds and n > 1 else [""]):
                for replicas in (a.replicas.split(",") if a.replicas and n > 1 else [""]):
                    runs.append(one(n, a, folder, inp, ids, env, rounds, replicas))
                    print(json.dumps(runs[-1]), flush=True)
    print("ranks  rounds  mode      rows/pass max/med  decode tok/s  pass s (median)  s a decode step  prompt passes s  "
          "over 1 rank  rank 0 blocked  took/estimate  peaks MiB")
    base = [r["decode_tokens_per_s"] for r in runs if r["ranks"] == 1]
    for r in runs:
        over = f"{r['decode_tokens_per_s'] / (sum(base) / len(base)):.2f}x" if base else "-"
        busy = f"{r['rank0_blocked_share']:.0%}" if r["rank0_blocked_share"] is not None else "-"
        print(f"{r['ranks']:>5}  {r['rounds'] or '-':>6}  {str(r['mode']):<8}  {r['rows_per_pass_max']:>4} / "
              f"{r['rows_per_pass_median']:<8}  {r['decode_tokens_per_s']:>12}  {r['pass_s_median']:>15}  "
              f"{r['round_s_median']!s:>15}  {r['prompt_passes_s']:>15}  {over:>11}  {busy:>14}  "
              f"{r['took_over_estimate'] or '-'!s:>13}  "
              f"{' '.join(str(c['peak_mib']) for c in r['cgroups'])}{'' if r['every_id_once'] else '  IDS WRONG'}")
    (a.out / "result.json").write_text(json.dumps({"model": str(folder), "cap": a.cap, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
