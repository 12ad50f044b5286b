"""One rank of a pipeline run of a fixed batch, greedy: the harness the identity test and
`benchmarks/stages.py` start on every rank (`launch.run`, or `mlx.launch --backend ring`).

    python -m spill.stages.run MODEL PROMPTS.json --max-tokens 8 --micro-batches 3 --out TOKENS.json

PROMPTS.json is a list of token-id lists; rank 0 writes each row's tokens to TOKENS.json. Every rank prints
one JSON line: its rank, layers, bytes held and timing (busy, waiting, wall seconds, per round).
"""

import argparse
import json
import sys
from pathlib import Path

from spill.errors import SpillError
from spill.streamer.plan import load_plan

from .link import join, measure
from .pipeline import Stage, run
from .split import stage_shares


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spill.stages.run")
    p.add_argument("model")
    p.add_argument("prompts")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=0, help="a round's micro-batches (default: the ranks)")
    p.add_argument("--out", help="rank 0: where to write each row's tokens")
    p.add_argument("--link", action="store_true", help="measure every hop's latency and bandwidth first")
    args = p.parse_args(argv)
    try:
        group = join()
        n, rank = group.size(), group.rank()
        share = stage_shares(load_plan(args.model), n, by_compute=True)[rank]   # every stage resident
        stage = Stage(args.model, share.layers, first=rank == 0, last=rank == n - 1)
        links = [vars(link) for link in measure(group)] if args.link and n > 1 else []
        prompts = json.loads(Path(args.prompts).read_text())
        tokens, timing = run(stage, group, prompts, args.max_tokens, args.micro_batches or n)
    except SpillError as err:
        print(f"rank error: {err}", file=sys.stderr)
        return 2
    if tokens is not None and args.out:
        Path(args.out).write_text(json.dumps(tokens))
    print(json.dumps({"rank": rank, "ranks": n, "layers": [share.layers.start, share.layers.stop],
                      "bytes": stage.bytes, "busy_s": timing.busy_s, "wait_s": timing.wait_s,
                      "wall_s": timing.wall_s, "rounds": timing.rounds, "links": links}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
