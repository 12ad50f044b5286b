"""The pass model on real passes: probe a factory model, run mixed passes, fit, and say how well the
fitted model predicts passes it was not fitted on, and the overlap the engine achieves.

    python benchmarks/calibrate.py [--size 1b] [--family llama] [--passes 24]

1. builds (or reuses) a factory model under --models; 2. opens its calibration in a fresh data
home (cold read probe + compute probe); 3. runs passes of mixed shapes through the streamer (decode
batches of 1-32 rows, prefill of 8-64-token prompts); 4. fits on every other pass and
predicts the rest; prints the prior, the fit, the overlap and the prediction errors.
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from spill import config
from spill.platform import preload_env


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=config.get("SPILL_TEST_BENCH_MODELS"))
    p.add_argument("--family", default="llama")
    p.add_argument("--size", default="1b")
    p.add_argument("--passes", type=int, default=24)
    return p.parse_args()


def main() -> None:
    env = preload_env(dict(os.environ))
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    a = parse()
    os.environ["SPILL_HOME"] = tempfile.mkdtemp(prefix="spill-calibrate-")   # a first use, every time
    from spill.admission.calibration import open_calibration
    from spill.admission.passmodel import Observation, fit
    from spill.factory import make_model
    from spill.streamer.core import Row, Streamer

    folder = Path(a.models) / f"{a.family}-{a.size}-bfloat16-seed0"
    if not (folder / "config.json").is_file():
        print(f"building {folder} ...", flush=True)
        make_model(folder, family=a.family, size=a.size, seed=0, dtype="bfloat16", shard_size="2GB")
    cal = open_calibration(folder)
    print("prior (probes):", _fmt(cal.prior), flush=True)
    engine, rnd = Streamer(folder, prefill_chunk=512), random.Random(0)
    observed, next_id = [], 0
    while len(observed) < a.passes:
        # 1. keep 1-32 rows running; newcomers' prompts are 8-64 tokens (long prompts on this
        # CPU take minutes a pass: their cost per token is the same term)
        want = rnd.choice([1, 4, 8, 16, 32])
        new = []
        while len(engine.rows) + len(new) < want:
            n = rnd.choice([8, 16, 16, 64])
            new.append(Row(next_id, [rnd.randrange(3, 2000) for _ in range(n)], rnd.randint(2, 6)))
            next_id += 1
        for r in new:
            engine.add(r)
        # 2. one pass: the rows decoding in it and the keys each scores (its KV and its new token), as planned
        rows = sum(len(p.live) for p in engine.pools.values())
        ctx = sum(int(n) + 1 for p in engine.pools.values() for r, n in zip(p.rows, p.lens) if r is not None)
        rep = engine.step()
        observed.append(Observation(rows, rep.prefill_tokens, ctx, rep.bytes_streamed, rep.seconds, rep.wait_s,
                                    rep.compute_s, prefill_groups=rep.prefill_groups))
        print(f"pass {len(observed):3d}: rows {rep.decode_rows:3d} prefill {rep.prefill_tokens:5d} "
              f"{rep.seconds:6.2f} s (wait {rep.wait_s:.2f}, compute {rep.compute_s:.2f})", flush=True)
    engine.close()
    # 3. fit on every other pass, predict the others
    train, test = observed[::2], observed[1::2]
    model = fit(cal.prior, train)
    errors = [model.pass_s(p) / p.seconds - 1 for p in test]
    print("fitted on", len(train), "passes:", _fmt(model))
    print(f"overlap achieved: {model.overlap:.2f} (1 = the shorter of IO and compute fully hidden)")
    print(f"held-out passes: median |error| {statistics.median(abs(e) for e in errors):.1%}, "
          f"worst {max(errors, key=abs):+.1%}; all passes fitted: {_fmt(fit(cal.prior, observed))}")


def _fmt(m) -> str:
    return (f"bandwidth {m.bandwidth / 1e9:.2f} GB/s, fixed {m.fixed_s:.3f} s, packed {m.packed_s:.3f} s, per row {m.per_row_s * 1e3:.2f} ms, "
            f"per prefill token {m.per_prefill_token_s * 1e3:.3f} ms, per context token "
            f"{m.per_context_token_s * 1e6:.2f} us, overlap {m.overlap:.2f}, overhead {m.overhead_s:.3f} s")


if __name__ == "__main__":
    main()
