"""MLX CPU streams that a layer's row-wise work is split over (platform.activation_streams): the SwiGLU's rows
(families/base.py) and a prompt's attention (attention.split_attention).

Each stream is a thread of MLX's for the life of the process, and in MLX 0.32 it belongs to the thread that
made it (elsewhere, eval fails with "There is no Stream(cpu, 1) in current thread"): so each thread that
computes makes its own, once."""

import threading

import mlx.core as mx
import numpy as np

_MADE = threading.local()


def cpu_streams(n: int) -> list:
    """n of this thread's MLX CPU streams; none where n is 1 (no split)."""
    made = _MADE.__dict__.setdefault("streams", [])
    while len(made) < n:
        made.append(mx.new_stream(mx.cpu))
    return made[:n] if n > 1 else []


def spread(streams: list, n: int, part, axis: int = 0) -> mx.array:
    """part(a, b) for even spans [a, b) of range(n), one a stream, joined along `axis`."""
    ends = np.linspace(0, n, len(streams) + 1).astype(int).tolist()
    parts = []
    for stream, a, b in zip(streams, ends, ends[1:]):
        with mx.stream(stream):
            parts.append(part(a, b))
    return mx.concatenate(parts, axis=axis)
