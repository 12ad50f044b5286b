"""A pass's decode rows as micro-batches: the pools' rows, in the order one `Decode` takes them, cut into M runs.

A pipeline stage whose layers are resident runs a pass micro-batch by micro-batch (`staged.py`), so the decode
group (one `Decode` over every pool, groups.py) is cut into M groups of about equal rows. A cut runs through a
pool's slots: a `Part` is slots lo..hi-1 of one pool, for one pass; a micro-batch is a `Decode` over its parts:

    pools       P0: slots 0-4 used      P1: slots 0-2 used          8 rows, M = 3 (3, 3 and 2 rows)
    mb 0        P0[0:3]
    mb 1        P0[3:5] + P1[0:1]
    mb 2        P1[1:3]

Read in order, the micro-batches are the joint group's rows in its own order, so their tokens come out as one
`Decode`'s would. The cut is a function of the pools alone, which every rank holds alike (it runs the same plans),
so every rank cuts the same. Quantized pools (--kv-bits) are not cut: their rows stay one micro-batch.
"""

import weakref

import mlx.core as mx
import numpy as np

from spill.streamer.groups import Decode, Pool

from .pipeline import micro_batches


class PartCache:
    """One layer's K and V of a Part: the pool's arrays, this pass's token of each of the part's rows written at
    its slot and column (a scatter of those rows only), attention over the part's slots and span."""

    def __init__(self, part: "Part", cache):
        self.part, self.cache = weakref.proxy(part), cache   # no cycle: the part goes with its pass

    @property
    def offset(self) -> mx.array:
        return self.part.offset

    @property
    def keys(self) -> mx.array:
        return self.cache.keys

    @property
    def values(self) -> mx.array:
        return self.cache.values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys [used, heads, 1, head_dim] of this pass, written at column len of each of the part's slots."""
        p, c = self.part, self.cache
        c.keys, c.values = _write(c.keys, keys, p), _write(c.values, values, p)
        return self.fetched()

    def fetched(self) -> tuple[mx.array, mx.array]:
        p, rows = self.part, slice(self.part.lo, self.part.lo + self.part.used)
        return self.cache.keys[rows, :, :p.span, :], self.cache.values[rows, :, :p.span, :]

    def make_mask(self, n: int, window_size: int | None = None, **_) -> mx.array:
        return self.part.mask(window_size)


def _write(store: mx.array, new: mx.array, part: "Part") -> mx.array:
    """`new` [n, heads, 1, dim] into `store` [slots, heads, width, dim] at slots lo..lo+n-1, each at its len: the
    store seen as [slots x heads, width, dim], one (row, column) a slot and head."""
    slots, heads, width, dim = store.shape
    n = new.shape[0]
    if part.at is None:   # the same slots and columns at every layer of the pass: made once
        rows = (np.arange(part.lo, part.lo + n)[:, None] * heads + np.arange(heads)[None, :]).ravel()
        part.at = (mx.array(rows), mx.array(np.repeat(part.lens[:n], heads)))
    flat = store.reshape(slots * heads, width, dim)
    flat[part.at] = new.reshape(n * heads, dim)
    return flat.reshape(slots, heads, width, dim)


class Part(Pool):
    """Slots lo..hi-1 of a decode pool, for one pass (a micro-batch's share of its rows). Its rows and lens are
    the pool's (lens a view: `advance` counts in the pool); it is never joined, moved or shrunk."""

    def __init__(self, pool: Pool, lo: int, hi: int):
        self.lo, self.slots, self.width, self.bits = lo, hi - lo, pool.width, pool.bits
        self.rows, self.lens = pool.rows[lo:hi], pool.lens[lo:hi]
        self.caches = [PartCache(self, c) for c in pool.caches]
        self.at = None   # (flat rows, columns) this pass's K and V go to (`_write`)


def split(pools: list[Pool], m: int, layers: int) -> list[Decode]:
    """The pools' rows in min(m, rows) micro-batches (their sizes differ by one at most), each a Decode over parts
    of the pools; one Decode over every pool where m is 1 or the pools are quantized."""
    used = [p.last_row() for p in pools]   # what each pool's `next_tokens` will feed
    if not pools:
        return []
    if m <= 1 or sum(used) <= 1 or any(p.bits for p in pools):
        return [Decode(pools, layers)]
    starts = np.cumsum([0, *used]).tolist()   # each pool's first row in the joint order
    out = []
    for batch in micro_batches(sum(used), m):
        parts = [Part(p, max(batch.start, s) - s, min(batch.stop, s + n) - s)
                 for p, s, n in zip(pools, starts, used) if max(batch.start, s) < min(batch.stop, s + n)]
        out.append(Decode(parts, layers))
    return out
