"""One rank of a staged run: rank 0 loads MODEL and runs the given plans (each sent to the others first);
ranks 1..N-1 load what rank 0 names and follow it until it lets them go. Started on every rank by `launch.run`
or `mlx.launch --backend ring`; a rank 1..N-1 needs no arguments (`spill up --ranks N` starts them so, and
`spill up` under `mlx.launch` runs this on every rank past 0).

    python -m spill.stages.serve MODEL --plans PLANS.msgpack --out PASSES.json [--micro-batches 1,2,4] [--replicas]

PLANS.msgpack is a msgpack list of `plans.pack` frames; rank 0 runs them once for each --micro-batches (a model
loaded anew each time; --replicas: every rank the whole model and a share of the rows) and writes a list: each
run's passes (each pass's tokens, rows that left and rows preempted) to PASSES.json. Every rank prints one JSON line at the end: its rank, layers, passes, tokens, bytes
read a pass, resident bytes and each pass's seconds, compute seconds and seconds blocked on a neighbour; rank 0
also each follower's memory (told at join) and each pass's figures from the followers (stages/figures.py).
Ranks 1..N-1 take --memory and --budget-fraction as `spill up` does: what they tell rank 0 their budget is.
SPILL_TEST_CRASH_STREAMER ("pass:n[:wedge]") in a rank's environment kills that rank (or blocks it) at its n-th pass.
"""

import argparse
import json
import sys
from pathlib import Path

import msgpack

from spill import config
from spill.actor import Fault, parent_watch
from spill.errors import SpillError
from spill.memory import memory_args
from spill.platform import without_torch
from spill.streamer.families.mlx_lm_parts import without_init

without_torch()   # before mlx-lm, whose transformers would import torch (a stage uses none of it)
if __name__ == "__main__":   # a rank's own process: mlx-lm's models without its __init__'s transformers
    without_init()
from . import plans  # noqa: E402
from .link import join  # noqa: E402
from .relay import Relay  # noqa: E402
from .replicas import Replicas  # noqa: E402
from .ranked import tell  # noqa: E402
from .staged import StagedStreamer, serve  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spill.stages.serve")
    p.add_argument("model", nargs="?", help="rank 0: the model (the others load what rank 0 names)")
    p.add_argument("--plans", help="rank 0: the plans to run")
    p.add_argument("--out", help="rank 0: where to write each pass's tokens")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--resident", action="store_true",
                   help="keep the stages' layers after their first read (split by compute, else by bytes)")
    p.add_argument("--replicas", action="store_true", help="rank 0: every rank the whole model, a share of the rows")
    p.add_argument("--micro-batches", default="0", help="rank 0: a run of the plans for each (comma-separated)")
    p.add_argument("--deadline", type=float, default=None, help="seconds to wait on a neighbour (SPILL_STAGE_TIMEOUT)")
    p.add_argument("--parent-fd", type=int, default=None, help="leave when this pipe closes (the group's supervisor)")
    p.add_argument("--memory", help="ranks 1..N-1: this host's working set (48GB); default: its memory or cgroup")
    p.add_argument("--budget-fraction", type=float, help="ranks 1..N-1: the budget's share of the working set")
    args = p.parse_args(argv)
    if args.parent_fd is not None:
        parent_watch(args.parent_fd)
    fault, passes, read, timing, runs, told = Fault("streamer"), [], [], [], [], []

    def on_pass(report) -> None:
        read.append(report.bytes_streamed)
        timing.append([report.seconds, report.compute_s, report.link_s])
        passes.append({"emitted": [[e.row_id, e.token, e.finish, e.position] for e in report.emitted],
                       "left": report.left, "preempted": report.preempted})
        fault.tick("pass")

    try:
        mem = memory_args(args.memory, args.budget_fraction)   # told to rank 0 at join: its admission prices this stage
        relay = Relay(join(), args.deadline or config.stage_timeout(), mem)
        if relay.rank > 0:
            engine = serve(relay, on_pass)
        else:
            frames = msgpack.unpackb(Path(args.plans).read_bytes()) if args.plans else []
            for m in [int(m) for m in args.micro_batches.split(",")]:
                runs.append(len(passes))
                engine = (Replicas(args.model, relay, prefill_chunk=args.prefill_chunk, resident=args.resident)
                          if args.replicas else
                          StagedStreamer(args.model, relay, prefill_chunk=args.prefill_chunk, resident=args.resident,
                                         micro_batches=m, by_compute=args.resident))
                ops = {"plan": lambda plan: (on_pass(engine.run(plan)), told.append(engine.followers)),
                       "clear": lambda _: engine.clear(),
                       "resident": engine.set_resident, "kv": lambda kv: engine.set_kv(*kv)}
                try:
                    for op, body in map(plans.unpack, frames):
                        ops[op](body)
                finally:
                    engine.close()
            tell(relay, "exit")
    except SpillError as err:
        print(f"rank error: {err}", file=sys.stderr, flush=True)
        return 2
    if relay.rank == 0 and args.out:
        Path(args.out).write_text(json.dumps([passes[a:b] for a, b in zip(runs, [*runs[1:], len(passes)])]))
    layers = [engine.layers.start, engine.layers.stop] if engine else None
    print(json.dumps({"rank": relay.rank, "ranks": relay.size, "layers": layers, "passes": len(passes),
                      "tokens": sum(len(p["emitted"]) for p in passes), "read": read,
                      "resident_bytes": sum(t.nbytes for t in engine.plan.resident) if engine else 0,
                      "timing": timing, **({"hosts": relay.hosts, "figures": told} if relay.rank == 0 else {})}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
