"""What a pass's prompt tokens cost by how they are split: one row, several rows of one prefill group,
or several groups (each group is its own attention; with --unfused, its own MLP product too).

    python benchmarks/prefill_groups.py [--size lean45] [--dtype float32] [--decode 20] [--tokens 96]
                                        [--splits 1,3] [--prompt 900] [--passes 4] [--unfused] [--device cpu]

Every layer is kept resident (the compute alone is timed). Each case: --decode rows decode, then
prompts of --prompt tokens (and up) start with a pace of --tokens a pass, shared out as the streamer
shares them; prints the median compute of --passes passes against decode alone, and the cost of a
prompt token in each split.
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

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


def main() -> None:
    env = preload_env(dict(os.environ))
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    a = parse()
    if a.device == "cpu":
        import mlx.core as mx
        mx.set_default_device(mx.cpu)
    folder = model_folder(a)
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
