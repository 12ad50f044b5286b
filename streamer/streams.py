"""MLX CPU streams that a layer's row-wise work is split over (platform.activation_streams): the SwiGLU's rows
(families/base.py) and a prompt's attention (groups.split_attention).

Each stream is a thread of MLX's for the life of the process, and in MLX 0.32 it belongs to the thread that
made it (elsewhere, eval fails with "There is no Stream(cpu, 1) in current thread"): so each thread that
computes makes its own, once."""

import threading

import mlx.core as mx

_MADE = threading.local()


def cpu_streams(n: int) -> list:
    """n of this thread's MLX CPU streams; none where n is 1 (no split)."""
    made = _MADE.__dict__.setdefault("streams", [])
    while len(made) < n:
        made.append(mx.new_stream(mx.cpu))
    return made[:n] if n > 1 else []
