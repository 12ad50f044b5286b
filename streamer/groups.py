"""Rows and groups of rows that run through a layer together.

A prefill group holds prompts left-padded to one length, e.g. prompts [1 3 5], [7], [2 6 8 9]:

    0 1 3 5        left_padding = [1, 3, 0]
    0 0 0 7        mlx-lm's BatchKVCache masks the padding and starts RoPE at 0 for each row
    2 6 8 9

It feeds `chunk` columns per pass; after its last column it samples a first token for each row,
and each row moves into the decode pool of its width (below).

A decode group is a `Pool`, one per width admission reserved: every layer's K and V preallocated
once as [slots, heads, width, head_dim], the shape admission priced. A row owns one slot; its
tokens sit at columns 0..len-1 and each pass writes the next one at column len (a scatter in
place), so a row joining copies only its own prompt's KV into its slot, and a row leaving just
frees its slot:

    slot  len   columns (width 8)          mask of this pass (query at column len)
    0     5     a a a a a . . .            1 1 1 1 1 1 0 0
    1     -     (free)                     1 0 0 0 0 0 0 0  (computed, never sampled)
    2     3     c c c . . . . .            1 1 1 1 0 0 0 0

Attention reads columns 0..max(len) of slots 0..last used; RoPE takes each row's own len. With `--kv-bits`
the pools are kvquant.QuantPools: the same slots and columns, K and V stored quantized.
"""

import weakref

import mlx.core as mx
import numpy as np

from .shares import prefill_width


class RowState:
    def __init__(self, row, sampler):
        self.row = row
        self.sampler = sampler
        self.tokens: list[int] = []      # generated so far, EOS excluded
        self.finish: str | None = None   # "stop" or "length" once ended
        self.history = None              # its prompt lookup index, made at its first drafts (speculate.py)

    def accept(self, token: int) -> str | None:
        """Record a sampled token (or the teacher's at this position); return why the row ends, if it does."""
        teacher = self.row.teacher
        if teacher is not None and len(self.tokens) < len(teacher):
            token = teacher[len(self.tokens)]
        if token in self.row.eos_ids:
            return "stop"
        self.tokens.append(token)
        return "length" if len(self.tokens) >= self.row.max_tokens else None


class Group:
    def __init__(self, rows: list[RowState], caches: list, prompt: np.ndarray | None = None):
        self.rows = rows
        self.caches = caches              # one BatchKVCache per layer
        self.prompt = prompt              # [B, L] left-padded ids while prefilling, else None
        self.done = 0                     # prompt columns already computed
        self._step = 0

    @classmethod
    def prefill(cls, rows: list[RowState], adapter, layers: range | None = None) -> "Group":
        """The rows' prompts left-padded, and a cache for each of `layers` (default every layer of the model)."""
        width = prefill_width([len(r.row.prompt) for r in rows])
        pads = [width - len(r.row.prompt) for r in rows]
        prompt = np.zeros((len(rows), width), dtype=np.int32)
        for j, r in enumerate(rows):
            prompt[j, pads[j]:] = r.row.prompt
        caches = [adapter.make_cache(i, pads) for i in (range(len(adapter.layers)) if layers is None else layers)]
        for c in caches:
            c.step = width   # one allocation of the prompt's width, not mlx-lm's 256-token steps
        return cls(rows, caches, prompt)

    @property
    def prefilling(self) -> bool:
        return self.prompt is not None

    def next_tokens(self, chunk: int) -> mx.array:
        """This pass's input ids [B, T]."""
        if self.prefilling:
            self._step = min(chunk, self.prompt.shape[1] - self.done)
            return mx.array(self.prompt[:, self.done:self.done + self._step])
        return mx.array([[r.tokens[-1]] for r in self.rows], dtype=mx.int32)

    def advance(self) -> bool:
        """After a pass: True when the group's last position should be sampled."""
        if self.prefilling:
            self.done += self._step
            if self.done < self.prompt.shape[1]:
                return False
            self.prompt = None
        return True

    def sampled(self) -> tuple[list[int], list[RowState]]:
        """(batch index, row) of each row whose last position is sampled this pass."""
        return list(range(len(self.rows))), self.rows


class SlotCache:
    """One layer's K and V of a Pool, as mlx-lm's attention uses a cache: `offset`, `update_and_fetch`, `make_mask`."""

    def __init__(self, pool: "Pool"):
        self.pool = weakref.proxy(pool)   # no cycle: a retired pool's KV is freed at once, not at a GC
        self.keys = self.values = None   # [slots, heads, width, head_dim], allocated at the first join

    @property
    def offset(self) -> mx.array:
        return self.pool.offset

    def place(self, slot: int, keys: mx.array, values: mx.array) -> None:
        """A joining row's KV [1, heads, n, head_dim] into columns 0..n-1 of its slot."""
        if self.keys is None:
            shape = (self.pool.slots, keys.shape[1], self.pool.width, keys.shape[3])
            self.keys, self.values = mx.zeros(shape, keys.dtype), mx.zeros(shape[:3] + values.shape[3:], values.dtype)
        n = keys.shape[2]
        self.keys[slot:slot + 1, :, :n, :] = keys
        self.values[slot:slot + 1, :, :n, :] = values

    admit = place   # a joining row's prompt KV, as its prefill group computed it

    def take(self, slot: int, n: int) -> tuple:
        """Columns 0..n-1 of a slot, copied out in the pool's own format (for `place` elsewhere)."""
        return mx.contiguous(self.keys[slot:slot + 1, :, :n, :]), mx.contiguous(self.values[slot:slot + 1, :, :n, :])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys [used, heads, T, head_dim] of this pass (T: its chunk), written at columns len..len+T-1 in place."""
        p = self.pool
        def put(store, new):
            if new.shape[0] < p.slots:   # unused slots past the last row: a write to their column 0
                new = mx.concatenate([new, mx.zeros((p.slots - new.shape[0], *new.shape[1:]), new.dtype)])
            return mx.put_along_axis(store, mx.broadcast_to(p.write_at, new.shape), new, axis=2)
        self.keys, self.values = put(self.keys, keys), put(self.values, values)
        return self.fetched()

    def fetched(self) -> tuple[mx.array, mx.array]:
        """The live rows' K and V over the pool's span (a view: nothing holds it past the layer)."""
        p = self.pool
        return self.keys[:p.used, :, :p.span, :], self.values[:p.used, :, :p.span, :]

    def make_mask(self, n: int, window_size: int | None = None, **_) -> mx.array:
        return self.pool.mask(window_size)


class Pool:
    """The decode group: rows in preallocated KV slots (see the module docstring)."""

    prefilling = False
    chunk = 1                            # tokens a row feeds this pass (speculate.py: its drafts after its last)
    slot_cache, bits = SlotCache, None   # kvquant.QuantPool: its own cache, K and V quantized

    def __init__(self, slots: int, width: int, layers: int):
        self.slots, self.width = slots, width
        self.rows: list[RowState | None] = [None] * slots
        self.lens = np.zeros(slots, dtype=np.int32)     # tokens held per slot
        self.caches = [self.slot_cache(self) for _ in range(layers)]

    def fits(self, rows: list[RowState]) -> bool:
        free = sum(r is None for r in self.rows)
        rows = [r for r in rows if r.finish is None]
        return free >= len(rows) and all(len(r.row.prompt) + r.row.max_tokens <= self.width for r in rows)

    def join(self, group: Group, picks: list[int]) -> None:
        """Rows `picks` of a prefill group into free slots: only their own KV is copied."""
        pads = [c.left_padding.tolist() for c in group.caches[:1]][0]
        end = group.caches[0]._idx
        for j in picks:
            r = group.rows[j]
            slot = self.rows.index(None)
            for mine, theirs in zip(self.caches, group.caches):
                mine.admit(slot, theirs.keys[j:j + 1, :, pads[j]:end, :], theirs.values[j:j + 1, :, pads[j]:end, :])
            self.rows[slot], self.lens[slot] = r, end - pads[j]

    def move(self, old: "Pool") -> None:
        """Every row of an outgrown pool into this one (a copy of the running batch: the exception),
        a layer at a time: each old layer is freed once copied, so the move holds one layer twice."""
        moved = []
        for j, r in enumerate(old.rows):
            if r is not None:
                slot = self.rows.index(None)
                self.rows[slot], self.lens[slot] = r, int(old.lens[j])
                moved.append((j, slot, int(old.lens[j])))
        for mine, theirs in zip(self.caches, old.caches):
            for j, slot, n in moved:
                mine.place(slot, *theirs.take(j, n))
            mx.eval(mine.keys, mine.values)
            theirs.keys = theirs.values = None

    def next_tokens(self, chunk: int) -> mx.array:
        """[used, 1]: each row's last token (0 in a free slot). Fixes this pass's offsets and mask."""
        self.used, self.chunk = self.last_row(), 1
        lens = self.lens[:self.used]
        self.span = int(lens.max()) + 1
        self.offset = mx.array(lens)
        self.write_at = mx.array(np.pad(lens, (0, self.slots - self.used)))[:, None, None, None]
        return mx.array([[r.tokens[-1] if r else 0] for r in self.rows[:self.used]], dtype=mx.int32)

    def last_row(self) -> int:
        """The slots up to the last row held: what a pass feeds (a free slot below it feeds padding)."""
        return max((j + 1 for j, r in enumerate(self.rows) if r is not None), default=0)

    def mask(self, window: int | None) -> mx.array:
        """[used, 1, chunk, span]: row j's position t sees columns 0..len_j + t (within the window, if any)."""
        cols = np.arange(self.span)[None, None, :]
        lens = self.lens[:self.used, None, None] + np.arange(self.chunk)[None, :, None]
        see = cols <= lens if window is None else (cols <= lens) & (cols > lens - window)
        return mx.array(see)[:, None, :, :]

    def advance(self) -> bool:
        self.lens[[j for j, r in enumerate(self.rows) if r is not None]] += 1
        return True

    def sampled(self) -> tuple[list[int], list[RowState]]:
        taken = [(j, r) for j, r in enumerate(self.rows[:self.used]) if r is not None]
        return [j for j, _ in taken], [r for _, r in taken]

    @property
    def live(self) -> list[RowState]:
        return [r for r in self.rows if r is not None]

    def without_finished(self) -> "Pool | None":
        """Finished rows free their slots and the rows in the last slots move down into them (each row's
        own KV copied), so a pass computes the live rows, not every slot up to the last one. None once
        no row is left."""
        for j, r in enumerate(self.rows):
            if r is not None and r.finish is not None:
                self.rows[j], self.lens[j] = None, 0
        moves = []   # (hole, last slot, tokens)
        while None in self.rows and (last := max((j for j, r in enumerate(self.rows) if r), default=-1)) > (
                hole := self.rows.index(None)):
            moves.append((hole, last, int(self.lens[last])))
            self.rows[hole], self.lens[hole], self.rows[last], self.lens[last] = self.rows[last], moves[-1][2], None, 0
        for c in self.caches if moves and self.caches[0].keys is not None else ():
            # the moving rows' KV copied out first: a write from a slice of the pool itself copies the whole pool
            rows = [c.take(j, n) for _, j, n in moves]
            mx.eval(rows)
            for (hole, _, _), (k, v) in zip(moves, rows):
                c.place(hole, k, v)
            del rows, k, v
            mx.eval(c.keys, c.values)   # a layer at a time, each written in place
        return self if any(r is not None for r in self.rows) else None


class JointCache:
    """One layer's KV of every decode pool as one batch (pool 0's rows, then pool 1's...): each pool
    writes its own slots; attention reads them padded to the longest span, the padding masked."""

    def __init__(self, decode: "Decode", layer: int):
        self.decode, self.pools = weakref.proxy(decode), decode.pools   # no cycle: replaced pools go at once
        self.parts = [p.caches[layer] for p in self.pools]
        self.kv_bits = self.pools[0].bits   # one KV format for every pool (not `bits`: mlx-lm reads that)

    @property
    def offset(self) -> mx.array:
        return self.decode.offset   # every pool's lens, joined once a pass (not once a layer)

    @property
    def keys(self) -> list:
        return [c.keys for c in self.parts]

    @property
    def values(self) -> list:
        return [c.values for c in self.parts]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Each pool's K and V as one batch padded to the longest span (lazy: `pooled_attention` reads each
        pool's own from `parts` and never evaluates the padded copy)."""
        span, ks, vs, start = max(p.span for p in self.pools), [], [], 0
        for p, c in zip(self.pools, self.parts):
            k, v = c.update_and_fetch(keys[start:start + p.used], values[start:start + p.used])
            if self.kv_bits:   # quantized: `pooled_attention` reads each pool's own, nothing to join
                start += p.used
                continue
            pad = [(0, 0), (0, 0), (0, span - k.shape[2]), (0, 0)]
            ks.append(mx.pad(k, pad) if span > k.shape[2] else k)
            vs.append(mx.pad(v, pad) if span > v.shape[2] else v)
            start += p.used
        if self.kv_bits:
            return None, None
        return (ks[0], vs[0]) if len(ks) == 1 else (mx.concatenate(ks), mx.concatenate(vs))

    def make_mask(self, n: int, window_size: int | None = None, **_) -> mx.array:
        span = max(p.span for p in self.pools)
        masks = [p.mask(window_size) for p in self.pools]
        masks = [mx.pad(m, [(0, 0), (0, 0), (0, 0), (0, span - m.shape[3])]) if m.shape[3] < span else m for m in masks]
        return masks[0] if len(masks) == 1 else mx.concatenate(masks)


class Decode:
    """Every decode pool as one group [sum of used slots, 1]: the layer's matmuls read each weight once
    for all of them (a group per pool would read it once per pool); attention goes through JointCache."""

    prefilling = False

    def __init__(self, pools: list[Pool], layers: int):
        self.pools = pools
        self.caches = [JointCache(self, i) for i in range(layers)]
        self.offset: mx.array | None = None

    def next_tokens(self, chunk: int) -> mx.array:
        tokens = [p.next_tokens(chunk) for p in self.pools]
        offsets = [p.offset for p in self.pools]
        self.offset = offsets[0] if len(offsets) == 1 else mx.concatenate(offsets)
        return tokens[0] if len(tokens) == 1 else mx.concatenate(tokens)

    def advance(self) -> bool:
        for p in self.pools:
            p.advance()
        return True

    def sampled(self) -> tuple[list[int], list[RowState]]:
        idx, rows, start = [], [], 0
        for p in self.pools:
            i, r = p.sampled()
            idx, rows, start = idx + [start + j for j in i], rows + r, start + p.used
        return idx, rows
