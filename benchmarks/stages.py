"""A pipeline's round with 1, 2 and 3 ranks on one machine over the ring backend on loopback: decode round
time, tokens/s, each stage's idle share (the bubble) measured and as the stage model prices it.

    python benchmarks/stages.py [--size small] [--ranks 1,2,3] [--rows 48] [--max-tokens 16] [--cores-per-rank 4]

Each rank runs `python -m spill.stages.run` on its layer range (resident), pinned to cores of its own where
--cores-per-rank is given (OpenBLAS's threads set to match); the first round (the prompts) is left out of
the decode figures, and the first decode round (it holds the fill) from the steady idle share. Every rank
count must give the same tokens.
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from spill.platform import preload_env
from spill.stages import launch
from spill.stages.model import idle_shares

sys.path.append(str(Path(__file__).resolve().parents[1]))   # the checkout's benchmarks; an installed spill wins
from benchmarks.pass_time import model_args, model_folder  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_args(p, "small")
    p.add_argument("--ranks", default="1,2,3")
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=0, help="a round's micro-batches (default: the ranks)")
    p.add_argument("--cores-per-rank", type=int, default=0, help="pin each rank to this many cores of its own")
    p.add_argument("--json", help="write the figures here too")
    return p.parse_args()


def idle(rounds: list[list]) -> list[float]:
    """Each stage's idle share over its (busy, wall) rounds."""
    return [1 - sum(b for b, _ in d) / sum(w for _, w in d) for d in rounds]


def one(n: int, args, folder: Path, prompts: Path, work: Path) -> dict:
    m = args.micro_batches or n
    out = work / f"tokens{n}.json"
    argv = ["-m", "spill.stages.run", str(folder), str(prompts), "--max-tokens", str(args.max_tokens),
            "--micro-batches", str(m), "--out", str(out), "--link"]
    k = args.cores_per_rank
    env = preload_env({**os.environ, **({"OPENBLAS_NUM_THREADS": str(k)} if k else {})})
    cpus = [set(range(r * k, (r + 1) * k)) for r in range(n)] if k else None
    ranks = launch.run(n, argv, timeout=900, env=env, cpus=cpus)
    if any(rc != 0 for rc, _, _ in ranks):
        sys.exit(f"{n} ranks failed:\n" + "\n".join(err[-1500:] for _, _, err in ranks))
    reports = [json.loads(stdout.strip().splitlines()[-1]) for _, stdout, _ in ranks]
    # (busy, wall) per decode round, per stage; the first holds the fill (stage 0 waits for the prompts' round)
    decode, steady = [r["rounds"][1:] for r in reports], [r["rounds"][2:] for r in reports]
    round_s = statistics.median(w for _, w in decode[0])
    stage_s = [statistics.median(b for b, _ in d) / m for d in decode]   # one micro-batch's seconds a stage
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    rows_mb = args.rows / m
    hops = reports[0]["links"]
    hop_s = [h["latency_s"] + (rows_mb * (4 if i == n - 1 else hidden * 4)) / h["bandwidth"]
             for i, h in enumerate(hops)] if n > 1 else [0.0]
    return {"ranks": n, "micro_batches": m, "layers": [r["layers"] for r in reports],
            "bytes": [r["bytes"] for r in reports], "round_s": round_s, "tokens_per_s": args.rows / round_s,
            "idle_measured": idle(steady), "idle_with_fill": idle(decode),
            "idle_model": idle_shares(stage_s, hop_s, m), "stage_s": stage_s, "hop_s": hop_s, "links": hops,
            "tokens": json.loads(out.read_text())}


def main() -> None:
    args = parse()
    folder = model_folder(args)
    rng = random.Random(0)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix="spill-stages-"))
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps([[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
                                   for _ in range(args.rows)]))
    results = [one(int(n), args, folder, prompts, work) for n in args.ranks.split(",")]
    print(f"model {folder.name}: {args.rows} rows, {args.prompt_tokens} prompt tokens, {args.max_tokens} new; "
          f"{args.cores_per_rank or 'all'} cores a rank")
    print("ranks  mbs  layers                   round ms  tok/s  speedup  idle (steady)    with fill        model"
          "            hop us")
    base = results[0]["tokens_per_s"]
    for r in results:
        same = "" if r["tokens"] == results[0]["tokens"] else "  TOKENS DIFFER"
        shares = " ".join(" ".join(f"{x:.2f}" for x in r[key]).ljust(16)
                          for key in ("idle_measured", "idle_with_fill", "idle_model"))
        print(f"{r['ranks']:>5}  {r['micro_batches']:>3}  {str(r['layers']):<24} {r['round_s'] * 1e3:8.1f}  "
              f"{r['tokens_per_s']:5.0f}  {r['tokens_per_s'] / base:6.2f}x  {shares} "
              f"{' '.join(f'{h * 1e6:.0f}' for h in r['hop_s'])}{same}")
    for r in results[1:]:
        for i, h in enumerate(r["links"]):
            print(f"{r['ranks']} ranks, hop {i}: latency {h['latency_s'] * 1e6:.0f} us, {h['bandwidth'] / 1e9:.2f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in results], indent=1))


if __name__ == "__main__":
    main()
