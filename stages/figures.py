"""What each follower tells rank 0 about itself: a few int64 figures, gathered round the ring (`Relay.gather`).

    at join     MEMORY   its working set (bytes) and budget fraction (millionths), from its own `spill up`'s
                         --memory, --budget-fraction and this host's memory or cgroup (spill/memory.py describe)
    each pass   PASS     its weights held or in flight, its share of the rows' KV and its process's resident
                         memory (bytes); the pass's seconds, compute and time blocked on a neighbour (microseconds)

A follower's pass figures reach rank 0 with the next pass (rank 0 takes them once that pass is through, so it
never waits for them; a pass that leaves no row running waits for its own), and rank 0's streamer hands every
stage's on in its pass report (`messages.StagePass`).
"""

import numpy as np

from spill import memory

MEMORY = ("working_set", "fraction_ppm")
PASS = ("weights", "kv", "rss", "seconds_us", "compute_us", "link_us")


def own_memory(args: dict) -> np.ndarray:
    """This host's MEMORY figures for the memory arguments of its `spill up` (`memory.memory_args`)."""
    d = memory.describe(args)
    return np.array([d["working_set"], round(d["budget_fraction"] * 1e6)], dtype=np.int64)


def memory_of(row) -> tuple[int, float]:
    """(working set bytes, budget fraction) of a follower's MEMORY figures."""
    return int(row[0]), int(row[1]) / 1e6


def _nbytes(x) -> int:
    if x is None:
        return 0
    if isinstance(x, (tuple, list)):   # quantized KV: (packed, scales, biases)
        return sum(_nbytes(y) for y in x)
    return x.nbytes


def held(stage) -> tuple[int, int]:
    """(weights, KV) bytes a streamer holds now: the tensors around its layers, its kept layers and the reader's
    layers in flight; every decode pool's and prefill group's KV for its layers."""
    weights = sum(t.nbytes for t in stage.plan.resident) + sum(stage.plan.layer_bytes(i) for i in stage.kept or ())
    weights += stage.reader.slot_bytes if stage.reader is not None else 0
    groups = [*stage.pools.values(), *stage.prefills.values()]
    return weights, sum(_nbytes(c.keys) + _nbytes(c.values) for g in groups for c in g.caches)


def own_pass(stage, report) -> np.ndarray:
    """A stage's PASS figures after `report`'s pass."""
    us = [round(s * 1e6) for s in (report.seconds, report.compute_s, report.link_s)]
    return np.array([*held(stage), report.rss, *us], dtype=np.int64)   # rss: as the pass's report measured it


def pass_of(row) -> dict:
    """A stage's PASS figures as `messages.StagePass` takes them."""
    weights, kv, rss, seconds, compute, link = (int(x) for x in row)
    return {"weights": weights, "kv": kv, "rss": rss, "seconds": seconds / 1e6, "compute_s": compute / 1e6,
            "link_s": link / 1e6}
