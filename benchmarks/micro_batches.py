"""Micro-batches in the product's pipeline: decode tokens/s of a resident group of ranks with M micro-batches a pass,
each M run in turn in one launch (and the list repeated), every rank's busy and blocked shares of its passes.

    python benchmarks/micro_batches.py [--size small] [--ranks 2] [--micro-batches 1,2,4] [--reps 3] [--rows 32]

The ranks run `python -m spill.stages.serve --resident` on plans of a decode-heavy batch: every row starts in the
first pass (one prefill group) and then decodes --max-tokens tokens, a token a pass. Rank r is pinned to core r
(OpenBLAS's threads set to 1). The first two passes of each run (the prompts, then the first micro-batched pass)
are left out of the decode figures. Every run must give the same tokens.
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import msgpack

from spill.platform import preload_env
from spill.stages import launch, plans
from spill.streamer.records import PassPlan, Row

sys.path.append(str(Path(__file__).resolve().parents[1]))   # the checkout's benchmarks; an installed spill wins
from benchmarks.pass_time import model_args, model_folder  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_args(p, "small")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--micro-batches", default="1,2,4")
    p.add_argument("--reps", type=int, default=3, help="times the list of micro-batches runs, in turn")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24)
    return p.parse_args()


def batch_plans(args, vocab: int) -> list[PassPlan]:
    rng = random.Random(0)
    rows = [Row(j, [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)], args.max_tokens)
            for j in range(args.rows)]
    return [PassPlan([(r, 1) for r in rows], {1: args.prompt_tokens})] + [PassPlan() for _ in range(args.max_tokens)]


def main() -> None:
    args = parse()
    folder = model_folder(args)
    work = Path(tempfile.mkdtemp(prefix="spill-micro-"))
    todo = batch_plans(args, json.loads((folder / "config.json").read_text())["vocab_size"])
    (work / "plans.msgpack").write_bytes(msgpack.packb([plans.pack("plan", p) for p in todo]))
    ms = [int(m) for m in args.micro_batches.split(",")] * args.reps
    argv = ["-m", "spill.stages.serve", str(folder), "--plans", str(work / "plans.msgpack"), "--resident",
            "--micro-batches", ",".join(map(str, ms)), "--out", str(work / "passes.json")]
    env = preload_env({**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    ranks = launch.run(args.ranks, argv, timeout=3000, env=env, cpus=[{r % os.cpu_count()} for r in range(args.ranks)])
    if any(rc != 0 for rc, _, _ in ranks):
        sys.exit("\n".join(err[-1500:] for _, _, err in ranks))
    timing = [json.loads(out.strip().splitlines()[-1])["timing"] for _, out, _ in ranks]
    runs = json.loads((work / "passes.json").read_text())
    n = len(todo)
    decode = args.rows * (args.max_tokens - 2)   # tokens of the passes counted (each row one a pass)
    figures: dict[int, list] = {}
    for k, m in enumerate(ms):
        per_rank = [t[k * n + 2:(k + 1) * n] for t in timing]
        wall = sum(s for s, _, _ in per_rank[0])
        shares = [(sum(c for _, c, _ in p) / sum(s for s, _, _ in p), sum(w for _, _, w in p) / sum(s for s, _, _ in p))
                  for p in per_rank]
        figures.setdefault(m, []).append((decode / wall, shares))
    print(f"model {folder.name}: {args.ranks} ranks, a core each, resident; {args.rows} rows, {args.prompt_tokens} "
          f"prompt tokens, {args.max_tokens} new; decode tokens/s over passes 3..{n} of each run")
    print(f"  M  tokens/s (each run)          median  vs M={ms[0]}  (each rep's)   busy / blocked share of each rank's "
          "passes (median run)")
    base = [t for t, _ in figures[ms[0]]]
    for m, got in figures.items():
        rates = [t for t, _ in got]
        ratio = statistics.median(t / b for t, b in zip(rates, base))   # against the run beside it in time
        mid = sorted(got, key=lambda g: g[0])[len(got) // 2][1]
        print(f"{m:>3}  {' '.join(f'{t:6.1f}' for t in rates):<28} {statistics.median(rates):6.1f}  "
              f"{statistics.median(rates) / statistics.median(base):5.2f}x ({ratio:5.2f}x)   "
              + "  ".join(f"r{r} {b:.2f}/{w:.2f}" for r, (b, w) in enumerate(mid)))
    same = all(run == runs[0] for run in runs)
    print("tokens: the same in every run" if same else "TOKENS DIFFER between runs")


if __name__ == "__main__":
    main()
