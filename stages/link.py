"""The link between stages: MLX's ring group over TCP, and each hop's latency and bandwidth measured at start.

A pipeline sends stage i's hidden states to stage i+1 and the last stage's tokens back to stage 0: in MLX's
ring every one of these hops is between neighbours (the only sends the ring allows). `measure` times each hop
with a ping-pong between its two ranks while the others wait, a few bytes for the latency and a few MiB for
the bandwidth; the estimate prices a micro-batch's hop as `Link.seconds(bytes)`.
"""

import os
import time

import mlx.core as mx

from spill import config
from spill.errors import SpillError

from .model import Link


def join(backend: str = "ring") -> "mx.distributed.Group":
    """This process's group, as `mlx.launch` (or `launch.spawn`) set it up through MLX_RANK and MLX_HOSTFILE
    (MLX's launcher contract, not a spill setting); a group of one where neither is set."""
    if "MLX_RANK" not in os.environ and "MLX_HOSTFILE" not in os.environ:
        return mx.distributed.init(strict=False, backend=backend)
    if not mx.distributed.is_available(backend):
        raise SpillError(f"this MLX has no {backend} backend for mx.distributed; install an MLX build with it "
                         "(pip install -U 'mlx[cpu]' on Linux)")
    deadline = time.monotonic() + config.ready_timeout()
    while True:
        try:
            return mx.distributed.init(strict=True, backend=backend)
        except RuntimeError as err:   # MLX's ring gives up on a neighbour after ~15 s: one starting slowly is retried
            if "couldn't connect" in str(err).lower() and time.monotonic() < deadline:
                continue
            raise SpillError(f"could not join the {backend} group ({' '.join(str(err).split())}); start every rank "
                             "with mlx.launch --backend ring, or set MLX_RANK and MLX_HOSTFILE") from None


def _one_way(group, peer: int, x: mx.array, leads: bool, reps: int) -> float:
    """Half the fastest round trip of `x` between this rank and `peer` (the leading rank sends first): what the
    link can do, without the moments another process held the core."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if leads:
            mx.eval(mx.distributed.send(x, peer, group=group))
            mx.eval(mx.distributed.recv_like(x, peer, group=group))
        else:
            mx.eval(mx.distributed.send(mx.distributed.recv_like(x, peer, group=group), peer, group=group))
        times.append(time.perf_counter() - t0)
    return min(times) / 2


def measure(group, *, small: int = 64, large: int = 4 << 20, reps: int = 5) -> list[Link]:
    """Every hop i -> i+1 (the last back to 0), timed one at a time; every rank calls it and gets the same list."""
    n, rank = group.size(), group.rank()
    facts = [0.0] * (2 * n)   # hop h: its latency and bandwidth, filled by its leading rank h
    xs = [mx.zeros((max(1, b // 4),), dtype=mx.float32) for b in (small, large)]
    mx.eval(xs)
    for hop in range(n if n > 1 else 0):
        peer = (hop + 1) % n
        if rank not in (hop, peer):
            continue
        leads = rank == hop
        other = peer if leads else hop
        t_small, t_large = (_one_way(group, other, x, leads, reps) for x in xs)   # the large one's latency: noise
        if leads:
            facts[2 * hop] = t_small
            facts[2 * hop + 1] = xs[1].nbytes / t_large
    summed = mx.distributed.all_sum(mx.array(facts, dtype=mx.float32), group=group).tolist()
    return [Link(summed[2 * h], summed[2 * h + 1]) for h in range(n if n > 1 else 0)]
