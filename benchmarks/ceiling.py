"""How many decode tokens a second this CPU could give a model at all: every layer's matrix products alone,
nothing else a step does, against the disk's floor. Two bounds on any engine that streams the model:

    python benchmarks/ceiling.py MODEL --rows 184,256,512 [--read-gbps 2.4]

A step of R rows costs at least one layer's matrix products (q, k, v, o, gate, up, down) x the layers, in
float32 on MLX's CPU with OpenBLAS preloaded (as spill computes there); a streamed pass costs at least the
layers' bytes over a cold read. tok/s <= R / max(products, read). Run on an otherwise idle machine.
"""
import argparse
import os
import sys
import time
from pathlib import Path

from spill.platform import preload_env

sys.path.append(str(Path(__file__).resolve().parents[1]))   # last: tests.machine; an installed spill wins
from tests.machine import blas_core  # noqa: E402


def products(plan) -> dict[str, tuple[int, int]]:
    """Each matrix of the model's first layer, (out, in), from its plan (any family the streamer reads)."""
    return {t.name: t.shape for t in plan.layers[0] if len(t.shape) == 2 and t.name.endswith(".weight")}


def layer_seconds(mx, shapes: dict, rows: int, dtype, reps: int = 20) -> float:
    """The best of `reps` timings of one layer's products at `rows` rows."""
    ws = {k: mx.random.normal(s).astype(dtype) * 0.02 for k, s in shapes.items()}
    xs = {k: mx.random.normal((rows, s[1])).astype(dtype) for k, s in shapes.items()}
    mx.eval(ws, xs)
    step = lambda: mx.eval([xs[k] @ ws[k].T for k in shapes])   # noqa: E731
    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--rows", default="184,256,512")
    p.add_argument("--read-gbps", type=float, default=None, help="a cold read's GB/s (peers.py's JSON has one)")
    a = p.parse_args()
    env = preload_env()
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    import mlx.core as mx
    mx.set_default_device(mx.cpu)
    from spill.streamer.plan import load_plan
    plan = load_plan(a.model)
    dtype = mx.float32   # what the streamer computes in on a CPU (platform.default_dtype)
    shapes, layers, size = products(plan), len(plan.layers), plan.streamed_bytes
    flops = 2 * sum(o * i for o, i in shapes.values())
    print(f"{a.model.name}: {layers} layers, {size / 1e9:.2f} GB, {flops * layers / 1e9:.2f} GFLOP a token in "
          f"its products; {dtype}, {os.cpu_count()} cores, OpenBLAS kernels: {blas_core()}")
    read = size / (a.read_gbps * 1e9) if a.read_gbps else 0.0
    if read:
        print(f"a pass's read at {a.read_gbps} GB/s: {read:.2f} s")
    for rows in (int(r) for r in a.rows.split(",")):
        s = layer_seconds(mx, shapes, rows, dtype) * layers
        bound = rows / max(s, read)
        print(f"rows {rows}: products {s:.3f} s a step ({flops * layers * rows / s / 1e9:.0f} GFLOP/s), "
              f"{rows / s:.0f} tok/s from them alone" + (f", {bound:.0f} with the read" if read else ""))


if __name__ == "__main__":
    main()
