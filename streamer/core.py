"""The streamer core: rows, groups and one pass over the streamed layers. No sockets here.

A pass streams every layer once and runs every group through it while it is resident:

    group      rows  tokens this pass    cache
    decode     B     1 each (T=1)        a Pool per width admission reserved (e.g. 48 slots of 256
                                         tokens, 6 of 1280): one group, KV preallocated per slot
    prefill 1  b1    a chunk of prompts  its own BatchKVCache per layer, joins the pool when done
    prefill 2  b2    ...

Rows join at any pass (`add`), leave on EOS, max_tokens or `finish` (a stop string seen by the
caller), and never disturb the others. Resident (the advisor's choice when the model fits), each
layer's weights are kept after their first read and the reader closed once all are: later passes
take them from memory, through the same loop.
"""

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from spill import config, memory
from spill.errors import SpillError
from spill.platform import blas_threads_for, default_dtype, layers_in_flight, release_heap, set_blas_threads

from .families import adapter_for
from .groups import Decode, Group, Pool, RowState
from .shares import bucket, chunk_for
from .plan import load_plan
from .reader import WeightReader
from .sampling import RowSampler, SamplingParams, sample


@dataclass
class Row:
    id: int | str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_ids: frozenset[int] = frozenset()
    teacher: tuple[int, ...] | None = None   # fed instead of the sampled tokens (`spill check`)
    width: int = 0           # the reserved decode pool it joins (0: an unreserved one, grown as rows come)


@dataclass
class Emitted:
    """One sampled token. `finish` is "stop" (the token is EOS: not part of the text) or "length"."""
    row_id: str
    token: int
    finish: str | None = None
    logits: np.ndarray | None = None


@dataclass
class PassReport:
    index: int
    emitted: list[Emitted]
    decode_rows: int
    prefill_tokens: int          # prompt positions computed this pass (padding included)
    seconds: float
    wait_s: float                # compute thread blocked on the reader
    compute_s: float             # layer math, eval included
    bytes_streamed: int
    active_memory: int
    peak_memory: int
    left: list = field(default_factory=list)        # ids of rows that left this pass, however they ended
    preempted: list = field(default_factory=list)   # ids of rows dropped by `preempt`, to run again
    cache_memory: int = 0                           # MLX's buffer cache
    reader_memory: int = 0                          # the reader's read buffers
    rss: int = 0                                    # this process's resident memory
    cgroup_usage: int | None = None                 # the limiting cgroup's usage less its inactive page cache
    minor_faults: int = 0                           # this pass's page faults
    major_faults: int = 0
    read_s: float = 0.0                             # the reader's seconds in read calls (beside the compute)
    prefill_groups: int = 0                         # prefill groups that ran: each its own attention (families run_layer)
    prefill_context: int = 0                        # prompt tokens this pass x the keys each scores (cached + chunk)
    pace: int = 0                                   # the prefill budget it ran with (admission's PACE; 0: a chunk a row)


def _free_cache() -> None:
    """MLX's cache emptied and the freed pages handed back to the OS, not kept by the C heap."""
    mx.clear_cache()
    release_heap()


def _in_flight(resident: bool) -> int:
    """The reader's layers in flight: two where layers are kept (never released), else the platform's."""
    return 2 if resident else layers_in_flight()


class Streamer:
    def __init__(self, folder, *, dtype: mx.Dtype | None = "auto", prefill_chunk: int = 512,
                 read_ahead: bool = True, drop_cache: bool = True, keep_logits: bool = False,
                 seed: int = 0, resident: bool = False):
        if prefill_chunk < 1:
            raise SpillError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.plan = load_plan(folder)
        self.adapter = adapter_for(self.plan)
        self.dtype = default_dtype() if dtype == "auto" else dtype
        self.prefill_chunk = prefill_chunk
        self.prefill_budget: int | None = None   # prompt tokens a pass may prefill in all (admission's PACE); None: a chunk a row
        self.keep_logits = keep_logits
        self.seed = seed
        self._cpu, self._threads = mx.default_device() == mx.cpu, 0   # OpenBLAS's threads, set each pass
        self._reader_args = dict(dtype=self.dtype, read_ahead=read_ahead, drop_cache=drop_cache)
        self.reader = WeightReader(self.plan, **self._reader_args, in_flight=_in_flight(resident))
        self.adapter.load_resident(self.reader.read_resident())
        self.kept: dict[int, dict] | None = {} if resident else None   # resident: layer -> its weights
        self._closed_s = {"wait_s": 0.0, "read_s": 0.0}   # reader seconds of readers closed since (resident)
        self.pools: dict[int, Pool] = {}             # a row's width -> the decode pool it joins
        self.reservation: dict[int, int] = {}        # width -> slots, as admission priced them
        self.pool_moves = 0       # pools outgrown and copied (never, under admission's reservation)
        self.prefills: list[Group] = []
        self.pending: list[RowState] = []
        self.rows: dict[str, RowState] = {}
        self.left: list = []      # rows retired since the last report
        self.preempted: list = []
        self._faults = memory.process_memory()
        self.passes = 0

    # -- rows ------------------------------------------------------------------------------
    def add(self, row: Row) -> None:
        """Queue a row; it starts prefilling in the next pass."""
        if row.id in self.rows:
            raise SpillError(f"row {row.id!r} is already running; give each row a unique id")
        if not row.prompt:
            raise SpillError(f"row {row.id!r} has an empty prompt")
        if row.max_tokens < 1:
            raise SpillError(f"row {row.id!r}: max_tokens must be at least 1, got {row.max_tokens}")
        state = RowState(row, RowSampler(row.sampling, self.seed + len(self.rows) + self.passes))
        self.rows[row.id] = state
        self.pending.append(state)

    def finish(self, row_id: str, reason: str = "stop") -> None:
        """End a row from outside (a stop string, a cancel); it leaves at the next pass."""
        state = self.rows.get(row_id)
        if state is not None and state.finish is None:
            state.finish = reason

    def preempt(self, row_ids, pools=()) -> None:
        """Drop running rows before the next pass (memory above the hard line), and shrink the pools to
        `pools` ([slots, width]); they are reported as preempted and run again from their prompts when admitted."""
        if pools:
            self.reserve(pools)
        for rid in row_ids:
            state = self.rows.get(rid)
            if state is not None and state.finish is None:
                state.finish = "preempted"
        for g in [g for g in self.prefills if any(r.finish == "preempted" for r in g.rows)]:
            self.prefills.remove(g)   # its other rows start their prefill again
            self.pending += [r for r in g.rows if r.finish is None]

    def reserve(self, pools) -> None:
        """The decode pools' shapes, reserved by admission: [slots, width] each, `slots` rows of up to
        `width` tokens; a pool above its slots shrinks at the next pass."""
        self.reservation = {width: slots for slots, width in pools}

    @property
    def resident(self) -> bool:
        return self.kept is not None

    def set_resident(self, resident: bool) -> None:
        """Keep the layers from the next pass on, or drop them and stream again."""
        if resident == self.resident:
            return
        self.kept = {} if resident else None
        if self.reader is None:
            self.reader = WeightReader(self.plan, **self._reader_args)
        self.reader.in_flight = _in_flight(resident)
        _free_cache()

    def _close_reader(self) -> None:
        self._closed_s = {k: self._reader_s(k) for k in self._closed_s}
        self.reader.close()
        self.reader = None

    def _reader_s(self, key: str) -> float:
        """The reader's cumulative wait_s or read_s (seconds in read calls), closed readers' included."""
        return self._closed_s[key] + (self.reader.stats()[key] if self.reader is not None else 0.0)

    def set_cache_limit(self, limit: int) -> None:
        """MLX's buffer cache limit, decided by the budget."""
        mx.set_cache_limit(limit)

    def clear(self) -> None:
        """Drop every row and its KV (a reset of the group); the weights plan stays."""
        self.pools, self.reservation, self.prefills, self.pending, self.rows = {}, {}, [], [], {}
        self.prefill_budget = None

    @property
    def idle(self) -> bool:
        return not self.rows

    # -- one pass ----------------------------------------------------------------------------
    def step(self) -> PassReport:
        t0 = time.perf_counter()
        wait0, read0 = self._reader_s("wait_s"), self._reader_s("read_s")
        # 1. retire rows that finished, start prefill groups for rows that arrived
        self._retire()
        self.prefills += [Group.prefill(rows, self.adapter) for rows in bucket(self.pending)]
        self.pending = []
        pools = list(self.pools.values())
        groups = ([Decode(pools, len(self.adapter.layers))] if pools else []) + self.prefills
        if not groups:
            return self._report(t0, wait0, read0, 0.0, [], 0, 0)
        # 2. inputs: decode rows feed their last token, prefill groups their next chunk
        hs, masks, prefill_tokens, prefilling, attended = [], [], 0, len(self.prefills), 0
        chunk = self.prefill_chunk if self.prefill_budget is None else chunk_for(
            self.prefill_budget, sum(len(g.rows) for g in self.prefills), self.prefill_chunk)
        for g in groups:
            tokens = g.next_tokens(chunk)
            prefill_tokens += tokens.size if g.prefilling else 0
            attended += tokens.size * (g.done + tokens.shape[1]) if g.prefilling else 0   # keys a prompt token scores
            h = self.adapter.embed(tokens)
            if self.dtype is not None:
                h = h.astype(self.dtype)
            hs.append(h)
            masks.append(self.adapter.masks(h, g.caches))
        missing = [i for i in range(len(self.adapter.layers)) if self.kept is None or i not in self.kept]
        if self._cpu:   # OpenBLAS's threads share the cores with the reader's (platform.blas_threads_for)
            threads = blas_threads_for(max(h.shape[0] * h.shape[1] for h in hs), config.blas_threads(), bool(missing))
            if threads != self._threads and set_blas_threads(threads):
                self._threads = threads
        # 3. stream the layers: every group through each layer while it is resident
        compute_s, streamed = 0.0, 0
        if missing:
            if self._cpu:
                # MLX's CPU cache takes a freed buffer only while it fits under the limit and gives it back only at
                # its size: what earlier passes left there (prompts' activations, logits) kept every freed layer out,
                # so each was allocated anew (lean45, 23 rows: 651k page faults a pass, passes 6.6 s against ~4)
                mx.clear_cache()
            self.reader.start_pass(missing)
        for i in range(len(self.adapter.layers)):
            weights = self.kept.get(i) if self.kept is not None else None
            if weights is None:
                weights = self.reader.take(i)
                streamed += self.plan.layer_bytes(i)
                if self.kept is not None:
                    self.kept[i] = weights
            c0 = time.perf_counter()
            self.adapter.load_layer(i, weights)
            hs = self.adapter.run_layer(i, hs, [m[i] for m in masks], [g.caches[i] for g in groups])
            mx.eval(hs, [(g.caches[i].keys, g.caches[i].values) for g in groups])
            self.adapter.unload_layer(i)
            del weights
            if self.kept is None:
                self.reader.release(i)   # nothing holds the layer now: its memory takes a later one, unfilled
            compute_s += time.perf_counter() - c0
        # 4. head and sampling for rows at the end of their input
        c0 = time.perf_counter()
        emitting = [(g, h) for g, h in zip(groups, hs) if g.advance()]
        emitted = self._sample(emitting)
        compute_s += time.perf_counter() - c0
        # 5. prefill groups that finished their prompts join their decode pools
        joined = [g for g in self.prefills if not g.prefilling]
        for g in joined:
            self.prefills.remove(g)
            self._join(g)
        self._retire()   # rows that ended this pass leave now, so `idle` is true once all have
        if self.kept is not None and len(self.kept) == len(self.adapter.layers) and self.reader is not None:
            self._close_reader()   # every layer is resident: its buffers and files are not needed again
        if joined:
            # the prefill caches are the only KV buffers ever freed; left in MLX's cache they
            # would crowd out the weight buffers it recycles layer after layer
            mx.clear_cache()
        # the C heap's holes go back every pass: without it the heap grew to 425 MiB on the three-tier job
        release_heap()
        self.passes += 1
        return self._report(t0, wait0, read0, compute_s, emitted, prefill_tokens, streamed, prefilling, attended)

    def _sample(self, emitting) -> list[Emitted]:
        if not emitting:
            return []
        picks = [(g.sampled(), h) for g, h in emitting]
        rows = [r for (_, rs), _ in picks for r in rs]
        logits = self.adapter.head(mx.concatenate([h[mx.array(idx), -1, :] for (idx, _), h in picks if idx]))
        logits = logits.astype(mx.float32)
        tokens = sample(logits, [r.sampler for r in rows])
        kept = np.array(logits) if self.keep_logits else None
        out = []
        for j, (r, tok) in enumerate(zip(rows, tokens)):
            if r.finish is not None:
                continue  # ended from outside while its last step ran
            r.finish = r.accept(tok)
            out.append(Emitted(r.row.id, tok, r.finish, kept[j] if kept is not None else None))
        return out

    def _join(self, g: Group) -> None:
        """A finished prefill group's rows take slots in their pools, made at the reserved shape
        (rows that ended on their first token never take one)."""
        picks: dict[int, list[int]] = {}
        for j, r in enumerate(g.rows):
            if r.finish is None:
                picks.setdefault(r.row.width, []).append(j)
        for width, js in picks.items():
            rows, pool = [g.rows[j] for j in js], self.pools.get(width)
            if pool is None:
                pool = self.pools[width] = Pool(*self._shape(width, rows), len(self.adapter.layers))
            elif not pool.fits(rows):   # rows past the reservation: a bigger pool, copied once
                old, pool = pool, Pool(*self._shape(width, pool.live + rows), len(self.adapter.layers))
                pool.move(old)
                self.pools[width] = pool
                self.pool_moves += 1
                _free_cache()   # the old pool's layers, freed one by one
            pool.join(g, js)

    def _shape(self, width: int, rows: list[RowState]) -> tuple[int, int]:
        longest = max(len(r.row.prompt) + r.row.max_tokens for r in rows)
        slots = self.reservation.get(width, 0)
        if width and slots and width >= longest:   # rows past a reservation (admission's view a pass
            return max(slots, len(rows)), width    # behind): a slot each, no spare slots nobody priced
        return max(8, 2 * len(rows)), -(-longest // 256) * 256

    def _retire(self) -> None:
        """Drop finished rows from the decode pools and from the bookkeeping; shrink a pool above its
        reserved slots (a preemption or a new share: its rows are copied once)."""
        shrunk = False
        for width, pool in list(self.pools.items()):
            pool = pool.without_finished()
            slots = self.reservation.get(width, 0) if width else 0
            if pool is not None and len(pool.live) <= slots < pool.slots:
                old, pool = pool, Pool(slots, pool.width, len(self.adapter.layers))
                pool.move(old)
                del old
                shrunk = True
            if pool is None:
                del self.pools[width]
            else:
                self.pools[width] = pool
        if shrunk:
            _free_cache()
        self.pending = [r for r in self.pending if r.finish is None]
        live = {id(r) for g in [*self.pools.values(), *self.prefills] for r in g.rows if r is not None}
        live |= {id(r) for r in self.pending}
        for rid in [rid for rid, r in self.rows.items() if r.finish is not None and id(r) not in live]:
            state = self.rows.pop(rid)
            (self.preempted if state.finish == "preempted" else self.left).append(rid)

    def _report(self, t0, wait0, read0, compute_s, emitted, prefill_tokens, streamed, groups=0, attended=0) -> PassReport:
        left, self.left = self.left, []
        preempted, self.preempted = self.preempted, []
        now, before = memory.process_memory(), self._faults
        self._faults = now
        return PassReport(
            index=self.passes, emitted=emitted,
            decode_rows=sum(len(p.live) for p in self.pools.values()),
            prefill_tokens=prefill_tokens, prefill_groups=groups, prefill_context=attended, seconds=time.perf_counter() - t0,
            wait_s=self._reader_s("wait_s") - wait0, read_s=self._reader_s("read_s") - read0, compute_s=compute_s,
            bytes_streamed=streamed, active_memory=mx.get_active_memory(),
            peak_memory=mx.get_peak_memory(), left=left, preempted=preempted,
            cache_memory=mx.get_cache_memory(), reader_memory=self.reader.buffer_bytes if self.reader else 0,
            rss=now.rss,
            cgroup_usage=memory.cgroup_usage(), minor_faults=now.minor_faults - before.minor_faults,
            major_faults=now.major_faults - before.major_faults, pace=self.prefill_budget or 0)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
