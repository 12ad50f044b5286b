"""What a pass's prompt tokens cost by how they are split: one row, several rows of one prefill group,
or several groups (each group is its own attention; with --unfused, its own MLP product too); with
--context, by the context each chunk attends to.

    python benchmarks/prefill_groups.py [--size lean45] [--dtype float32] [--decode 20] [--tokens 96]
                                        [--splits 1,3] [--prompt 900] [--passes 4] [--unfused] [--device cpu]
    python benchmarks/prefill_groups.py --context [--whole 128,256,512,900] [...]

Every layer is kept resident (the compute alone is timed). Each case: --decode rows decode, then
prompts of --prompt tokens (and up) start with a pace of --tokens a pass, shared out as the streamer
shares them; prints the median compute of --passes passes against decode alone, and the cost of a
prompt token in each split. --context: one --prompt row paced at --tokens a pass (each chunk attends to
those before it), then --whole prompts in one pass each; prints each pass's compute beyond decode alone
and a least-squares fit a * tokens + b * tokens x (tokens before + tokens).
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pass_time import model_args, model_folder  # noqa: E402
from spill.platform import preload_env  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_args(p, "lean45")
    p.add_argument("--decode", type=int, default=20)
    p.add_argument("--tokens", type=int, default=96, help="the pace: prompt tokens a pass, in all")
    p.add_argument("--splits", default="1,3", help="numbers of prefilling rows (or groups) to share them")
    p.add_argument("--prompt", type=int, default=900, help="the prefilling rows' prompt length")
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--unfused", action="store_true", help="each group through its own MLP too (no fused product)")
    p.add_argument("--device", choices=["default", "cpu"], default="default", help="cpu: the CPU cores where a GPU is")
    p.add_argument("--context", action="store_true", help="the cost of a chunk by the context it attends to")
    p.add_argument("--whole", default="128,256,512,900", help="--context: prompt lengths prefilled in one pass each")
    p.set_defaults(dtype="float32")
    return p.parse_args()


def case(folder, a, rows: int, groups: bool) -> float:
    """Median compute seconds of a pass with `rows` prefilling rows (each its own group if `groups`);
    rows=0: decode alone."""
    from spill.streamer.core import Row, Streamer
    engine = Streamer(folder, resident=True)
    engine.adapter.fused_mlp &= not a.unfused
    for i in range(a.decode):
        engine.add(Row(f"d{i}", [3 + i % 50] * 32, 10_000))
    engine.step()                                  # the decode rows' prompts, every layer read once
    engine.prefill_budget = a.tokens
    for j in range(rows):   # lengths 1.3x apart are never bucketed together (groups.bucket's slack is 1.25)
        n = int(a.prompt * 1.3 ** j) if groups else a.prompt
        engine.add(Row(f"p{j}", [7 + j] * n, 4))
    seconds = []
    for _ in range(a.passes + 1):
        rep = engine.step()
        seconds.append(rep.compute_s)
        assert rep.decode_rows == a.decode and rep.prefill_tokens == (a.tokens if rows else 0), rep
    engine.close()
    return statistics.median(seconds[1:])          # the first pass allocates the groups' caches


def engine_with_decode(folder, a):
    from spill.streamer.core import Row, Streamer
    engine = Streamer(folder, resident=True)
    for i in range(a.decode):
        engine.add(Row(f"d{i}", [3 + i % 50] * 32, 10_000))
    engine.step()                                   # the decode rows' prompts, every layer read once
    engine.step()                                   # their pool's first pass allocates it: not a prompt's cost
    return engine


def decode_alone(folder, a) -> float:
    engine = engine_with_decode(folder, a)
    s = [engine.step().compute_s for _ in range(4)]
    engine.close()
    return statistics.median(s[1:])


def paced(folder, a) -> list[tuple[int, int, float]]:
    """(chunk, tokens before it, compute s) of each pass that prefills the --prompt row --tokens at a time."""
    from spill.streamer.core import Row
    engine = engine_with_decode(folder, a)
    engine.prefill_budget = a.tokens
    engine.add(Row("p", [7] * a.prompt, 4))
    out, before = [], 0
    while before < a.prompt:
        rep = engine.step()
        out.append((rep.prefill_tokens, before, rep.compute_s))
        before += rep.prefill_tokens
    engine.close()
    return out


def whole(folder, a, n: int) -> tuple[int, int, float]:
    from spill.streamer.core import Row
    engine = engine_with_decode(folder, a)
    engine.prefill_budget = engine.prefill_chunk = n
    engine.add(Row("w", [9] * n, 4))
    rep = engine.step()
    engine.close()
    assert rep.prefill_tokens == n, rep
    return n, 0, rep.compute_s


def by_context(folder, a) -> None:
    """--context: each chunk's compute beyond decode alone, by the prompt tokens before it."""
    base = decode_alone(folder, a)
    print(f"{folder.name}, {len(os.sched_getaffinity(0))} cores; {a.decode} rows decoding: {base:.3f} s a pass")
    runs = paced(folder, a)[1:]    # the first paced pass allocates the group's cache
    runs += [whole(folder, a, int(n)) for n in a.whole.split(",") if n]
    print("| chunk | tokens before | compute s | beyond decode s | s a token |")
    print("|---:|---:|---:|---:|---:|")
    for n, o, s in runs:
        print(f"| {n} | {o} | {s:.3f} | {s - base:.3f} | {(s - base) / n:.4f} |", flush=True)
    x = np.array([[n, n * (o + n)] for n, o, _ in runs], dtype=float)
    y = np.array([s - base for _, _, s in runs])
    (per_token, per_pair), *_ = np.linalg.lstsq(x, y, rcond=None)
    flat = float(y.sum() / x[:, 0].sum())
    print(f"fit: {per_token:.5f} s a token + {per_pair:.3e} s a pair attended (mean |error| "
          f"{np.abs(x @ [per_token, per_pair] - y).mean():.3f} s); a flat price: {flat:.5f} s a token "
          f"(mean |error| {np.abs(x[:, 0] * flat - y).mean():.3f} s)")


def main() -> None:
    env = preload_env(dict(os.environ))
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    a = parse()
    if a.device == "cpu":
        import mlx.core as mx
        mx.set_default_device(mx.cpu)
    folder = model_folder(a)
    if a.context:
        return by_context(folder, a)
    base = case(folder, a, 0, False)
    print(f"{folder.name}, {len(os.sched_getaffinity(0))} cores; {a.decode} rows decoding; {a.tokens} prompt tokens a pass; "
          f"{'an MLP a group' if a.unfused else 'one MLP for every group'}")
    print(f"decode alone: {base:.3f} s a pass")
    print("| prefilling | rows | compute s | beyond decode s | s a prompt token |")
    print("|---|---:|---:|---:|---:|")
    for n in [int(s) for s in a.splits.split(",")]:
        for groups in ([False, True] if n > 1 else [False]):
            s = case(folder, a, n, groups)
            label = "groups" if groups else ("one row" if n == 1 else "rows of one group")
            print(f"| {label} | {n} | {s:.3f} | {s - base:.3f} | {(s - base) / a.tokens:.4f} |", flush=True)


if __name__ == "__main__":
    main()
