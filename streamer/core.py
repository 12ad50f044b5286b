"""The streamer core: rows, groups and one pass over the streamed layers. No sockets here.

A pass streams every layer once and runs every group through it while it is resident:

    group      rows  tokens this pass    cache
    decode     B     1 each (T=1)        a Pool per width admission reserved (e.g. 48 slots of 256
                                         tokens, 6 of 1280): one group, KV preallocated per slot
    prefill 1  b1    a chunk of prompts  its own BatchKVCache per layer, joins the pool when done
    prefill 2  b2    ...

Each pass runs one plan (`run`): the rows that start, each prefilling group's chunk, the rows that leave
(dropped, or ended by a stop string the caller saw); rows also leave on EOS or max_tokens, and never
disturb the others. Resident (the advisor's choice when the model fits), each
layer's weights are kept after their first read and the reader closed once all are: later passes
take them from memory, through the same loop. A pipeline stage (stages/staged.py) runs the same pass on its
layer range: its input, its output and its rows' tokens cross to the other ranks at `_embed`,
`_stream_layers` and `_sample`.
"""

import dataclasses
import time

import mlx.core as mx

from spill import config, memory
from spill.errors import SpillError
from spill.platform import blas_threads_for, default_dtype, layers_in_flight, release_heap, set_blas_threads

from .families import adapter_for
from .draft import DraftModel
from .groups import Decode, Group, Pool, RowState
from .kvquant import chunk_refusal, pool_maker
from .shares import bucket, chunk_for
from .plan import load_plan
from .reader import WeightReader
from .records import Emitted, PassPlan, PassReport, Row  # noqa: F401 - the core's records, imported from here too
from .sampling import RowSampler
from . import speculate


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
                 seed: int = 0, resident: bool = False, kv_bits: int | None = None, kv_group_size: int = 64,
                 speculate: int = 0, draft: str | None = None, layers: range | None = None,
                 holds: set[str] | None = None):
        if prefill_chunk < 1:
            raise SpillError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.plan = load_plan(folder)
        self.adapter = adapter_for(self.plan)
        # the layers it runs, and the tensors around them it reads: all, or a pipeline stage's (stages/staged.py)
        self.layers = range(len(self.plan.layers)) if layers is None else layers
        if holds is not None:
            self.plan = dataclasses.replace(self.plan, resident=[t for t in self.plan.resident if t.name in holds])
        self.dtype = default_dtype() if dtype == "auto" else dtype
        Streamer.set_kv(self, kv_bits, kv_group_size)   # the pools' KV format (kvquant.py); a stage tells nobody yet
        self.prefill_chunk = prefill_chunk
        self.prefill_budget: int | None = None   # prompt tokens a pass of `step` may prefill in all; None: a chunk a row
        self.keep_logits = keep_logits
        self.seed = seed
        self.speculate = speculate   # the job's --speculate (K, or -1 auto); not 0: its sampled rows draw as `verify` does
        self.draft: DraftModel | None = None   # the resident draft model (--draft); None: drafts by prompt lookup
        self.set_draft(draft)
        self._cpu, self._threads = mx.default_device() == mx.cpu, 0   # OpenBLAS's threads, set each pass
        self._reader_args = dict(dtype=self.dtype, read_ahead=read_ahead, drop_cache=drop_cache)
        self.reader = WeightReader(self.plan, **self._reader_args, in_flight=_in_flight(resident))
        self.adapter.load_resident(self.reader.read_resident())
        self.kept: dict[int, dict] | None = {} if resident else None   # resident: layer -> its weights
        self._closed_s = {"wait_s": 0.0, "read_s": 0.0}   # reader seconds of readers closed since (resident)
        self.pools: dict[int, Pool] = {}             # a row's width -> the decode pool it joins
        self.reservation: dict[int, int] = {}        # width -> slots, as admission priced them
        self.prefills: dict[int, Group] = {}         # prefill group (the plan's number) -> its rows and KV
        self.waiting: list[Row] = []                 # rows added by a caller that plans alone (`add`), not started
        self.opened, self.dropping = 0, []           # prefill groups that caller opened; rows it drops next
        self.refused: list[tuple] = []               # rows a plan started that could not start: (id, why)
        self.rows: dict[str, RowState] = {}
        self.left: list = []      # rows retired since the last report
        self.preempted: list = []
        self._faults = memory.process_memory()
        self.passes = 0

    # -- the plan of a pass ------------------------------------------------------------------
    def run(self, plan: PassPlan) -> "PassReport":
        """One pass exactly as planned: drops and finishes first, the pools' shapes, the rows that start
        (each opens its prefill group), every prefilling group's chunk. A row that cannot start is refused."""
        for rid in plan.drop:
            self._end(rid, "preempted")
        for group, g in list(self.prefills.items()):
            if any(r.finish == "preempted" for r in g.rows):   # a group's KV is one allocation: it goes whole
                for r in g.rows:
                    r.finish = r.finish or "preempted"
                del self.prefills[group]
        for rid in plan.finish:
            self._end(rid, "stop")
        if plan.pools is not None:
            self.reserve(plan.pools)
        opening: dict[int, list[RowState]] = {}
        for row, group in plan.start:
            try:
                state = self._start(row)
                opening.setdefault(group, []).append(state)
            except SpillError as err:   # one bad row: its error line, and it leaves with this pass's report
                self.left.append(row.id)
                self.refused.append((row.id, str(err)))
        for group, rows in opening.items():
            self.prefills[group] = Group.prefill(rows, self.adapter, self.layers)
        return self._pass(plan.chunks, plan.drafts)

    def _start(self, row: Row) -> RowState:
        self._check(row)
        verified = self.speculate != 0 and row.teacher is None   # sampled rows: seeded draws, drafts or not
        state = RowState(row, RowSampler(row.sampling, self.seed + len(self.rows) + self.passes, verified))
        self.rows[row.id] = state
        return state

    def _end(self, row_id, reason: str) -> None:
        state = self.rows.get(row_id)
        if state is not None and state.finish is None:
            state.finish = reason

    # -- a caller without a scheduler (spill check, probes, tests): it plans alone, by the same rules ----------
    def _check(self, row: Row) -> None:
        if row.id in self.rows or any(w.id == row.id for w in self.waiting):
            raise SpillError(f"row {row.id!r} is already running; give each row a unique id")
        if not row.prompt:
            raise SpillError(f"row {row.id!r} has an empty prompt")
        if row.max_tokens < 1:
            raise SpillError(f"row {row.id!r}: max_tokens must be at least 1, got {row.max_tokens}")

    def add(self, row: Row) -> None:
        """Queue a row; it starts prefilling in the next `step`."""
        self._check(row)
        self.waiting.append(row)

    def finish(self, row_id, reason: str = "stop") -> None:
        """End a row from outside (a stop string); it leaves at the next pass."""
        if any(w.id == row_id for w in self.waiting):
            self.waiting = [w for w in self.waiting if w.id != row_id]
            self.left.append(row_id)
        self._end(row_id, reason)

    def preempt(self, row_ids, pools=None) -> None:
        """Drop running rows at the next `step` (with their prefill groups), the pools shrunk to `pools`."""
        self.dropping += list(row_ids)
        if pools:
            self.reserve(pools)

    def step(self, drafts: dict | None = None) -> "PassReport":
        """The next pass of the rows added: new rows in groups of like length (`bucket`), each prefilling
        row an equal share of `prefill_budget` (`chunk_for`), as the scheduler plans them; `drafts`: row -> its bound."""
        start = []
        for rows in bucket(self.waiting, length=lambda r: len(r.prompt)):
            self.opened += 1
            start += [(r, self.opened) for r in rows]
        self.waiting, drop, self.dropping = [], self.dropping, []
        prefilling = {g: len(grp.rows) for g, grp in self.prefills.items() if not set(drop) & {r.row.id for r in grp.rows}}
        prefilling.update({g: sum(1 for _, h in start if h == g) for _, g in start})
        chunk = self.prefill_chunk if self.prefill_budget is None else chunk_for(
            self.prefill_budget, sum(prefilling.values()), self.prefill_chunk)
        return self.run(PassPlan(start, dict.fromkeys(prefilling, chunk), drop, drafts=drafts or {}))

    def reserve(self, pools) -> None:
        """The decode pools' shapes, reserved by admission: [slots, width] each, `slots` rows of up to
        `width` tokens; a pool above its slots shrinks at the next pass."""
        self.reservation = {width: slots for slots, width in pools}

    def set_kv(self, bits: int | None, group_size: int) -> None:
        """The decode pools' KV format of the next rows (a reset: no pool is held)."""
        self.make_pool = pool_maker(bits, group_size, self.plan, self.dtype)
        self.kv_bits, self.kv_group_size = bits, group_size
        self.no_chunk = chunk_refusal(bits, group_size, self.plan, self.dtype)   # None: quantized pools take drafts
        self.said: set = set()   # that they do not, where --speculate K asked for drafts: said once a setting

    def set_draft(self, folder: str | None) -> None:
        """The draft model of the next rows (--draft), loaded where it changes; None: drafts by prompt lookup."""
        if (folder or None) != (self.draft.folder if self.draft else None):
            self.draft = DraftModel(folder, self.dtype, self.plan.config.get("vocab_size")) if folder else None

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
        self.pools, self.reservation, self.prefills, self.waiting, self.rows = {}, {}, {}, [], {}
        self.prefill_budget = None
        if self.draft is not None:
            self.draft.clear()

    @property
    def idle(self) -> bool:
        return not self.rows and not self.waiting

    # -- one pass ----------------------------------------------------------------------------
    def _pass(self, chunks: dict[int, int], bounds: dict | None = None) -> PassReport:
        t0 = time.perf_counter()
        wait0, read0 = self._reader_s("wait_s"), self._reader_s("read_s")
        # 1. retire rows that finished; the groups: every decode pool as one, then each prefill group
        self._retire()
        pools, prefills = list(self.pools.values()), list(self.prefills.items())
        decode = self._decode(pools)   # one group (a pipeline stage's micro-batches: several)
        groups = decode + [g for _, g in prefills]
        steps = [1] * len(decode) + [chunks.get(k, self.prefill_chunk) for k, _ in prefills]
        if not groups:
            return self._report(t0, wait0, read0, 0.0, [], 0, 0)
        missing = self._start_reads()   # the reads go on while the drafts and inputs are made
        # 2. inputs: decode rows feed their last token (and their drafts), prefill groups their planned chunk
        hs, masks, prefill_tokens, prefilling, attended = [], [], 0, len(prefills), 0
        off = speculate.off(self.no_chunk, self.speculate, self.said, kv_bits=self.kv_bits, kv_group_size=self.kv_group_size)
        drafts = speculate.proposals(groups[0], bounds, self.draft) if pools and bounds and not off else {}
        columns = 1
        for g, step in zip(groups, steps):
            tokens = speculate.chunk(g, drafts) if drafts and not g.prefilling else g.next_tokens(step)
            columns = tokens.shape[1] if drafts and not g.prefilling else columns
            prefill_tokens += tokens.size if g.prefilling else 0
            attended += tokens.size * (g.done + tokens.shape[1]) if g.prefilling else 0   # keys a prompt token scores
            hs.append(h := self._embed(tokens))
            masks.append(self.adapter.masks(h, g.caches))
        # 3. stream the layers: every group through each layer while it is resident
        hs, compute_s, streamed = self._stream_layers(groups, hs, masks, missing)
        # 4. head and sampling for rows at the end of their input
        c0 = time.perf_counter()
        emitting = [(g, h) for g, h in zip(groups, hs) if g.advance()]
        drafted = {r.row.id: len(drafts[id(r)]) for p in pools for r in p.live if id(r) in drafts} if drafts else {}
        verified, accepted = (speculate.decide(self.adapter, *emitting.pop(0), drafts, self.keep_logits) if drafts
                              else ([], {}))
        emitted = verified + self._sample(emitting)
        compute_s += time.perf_counter() - c0
        # 5. prefill groups that finished their prompts join their decode pools
        joined = [k for k, g in self.prefills.items() if not g.prefilling]
        for k in joined:
            self._join(self.prefills.pop(k))
        self._retire()   # rows that ended this pass leave now, so `idle` is true once all have
        if self.kept is not None and len(self.kept) == len(self.layers) and self.reader is not None:
            self._close_reader()   # every layer is resident: its buffers and files are not needed again
        if joined:
            # the prefill caches are the only KV buffers ever freed; left in MLX's cache they
            # would crowd out the weight buffers it recycles layer after layer
            mx.clear_cache()
        # the C heap's holes go back every pass: without it the heap grew to 425 MiB on the three-tier job
        release_heap()
        self.passes += 1
        report = self._report(t0, wait0, read0, compute_s, emitted, prefill_tokens, streamed, prefilling, attended)
        report.accepted, report.drafted, report.columns = accepted, drafted, columns
        return report

    def _decode(self, pools: list[Pool]) -> list:
        return [Decode(pools, len(self.layers))] if pools else []

    def _embed(self, tokens: mx.array) -> mx.array:
        """A group's input ids [B, T] -> its hidden states [B, T, hidden] in the compute dtype."""
        h = self.adapter.embed(tokens)
        return h.astype(self.dtype) if self.dtype is not None else h

    def _start_reads(self) -> list[int]:
        """The pass's reads started (the layers not kept), before its inputs are made: a draft model's steps and
        prompt lookup run while the first layers are read."""
        missing = [i for i in self.layers if self.kept is None or i not in self.kept]
        if missing:
            if self._cpu:
                # MLX's CPU cache takes a freed buffer only while it fits under the limit: what earlier passes left
                # there (prompts' activations, logits) would keep every freed layer out, each allocated (faulted) anew
                mx.clear_cache()
            self.reader.start_pass(missing)
        return missing

    def _stream_layers(self, groups: list, hs: list, masks: list, missing: list[int]) -> tuple[list, float, int]:
        """Every group through each of this streamer's layers while it is resident (read: `missing`, or kept): the
        groups' hidden states after the last, the compute seconds and the bytes read."""
        if self._cpu:   # OpenBLAS's threads share the cores with the reader's (platform.blas_threads_for)
            threads = blas_threads_for(max(h.shape[0] * h.shape[1] for h in hs), config.blas_threads(), bool(missing))
            if threads != self._threads and set_blas_threads(threads):
                self._threads = threads
        compute_s, streamed = 0.0, 0
        for k, i in enumerate(self.layers):   # k: the layer's place in the groups' caches (a stage holds its own)
            weights = self.kept.get(i) if self.kept is not None else None
            if weights is None:
                weights = self.reader.take(i)
                streamed += self.plan.layer_bytes(i)
                if self.kept is not None:
                    self.kept[i] = weights
            c0 = time.perf_counter()
            self.adapter.load_layer(i, weights)
            hs = self.adapter.run_layer(i, hs, [m[i] for m in masks], [g.caches[k] for g in groups])
            mx.eval(hs, [(g.caches[k].keys, g.caches[k].values) for g in groups])
            self.adapter.unload_layer(i)
            del weights
            if self.kept is None:
                self.reader.release(i)   # nothing holds the layer now: its memory takes a later one, unfilled
            compute_s += time.perf_counter() - c0
        return hs, compute_s, streamed

    def _sample(self, emitting) -> list[Emitted]:
        """Head and a token for each row at the end of its input (a pipeline stage: its tokens over the group)."""
        return speculate.draw(self.adapter, emitting, self.keep_logits)

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
                pool = self.pools[width] = self.make_pool(*self._shape(width, rows), len(self.layers))
            elif not pool.fits(rows):   # rows past the reservation: a bigger pool, copied once
                old, pool = pool, self.make_pool(*self._shape(width, pool.live + rows), len(self.layers))
                pool.move(old)
                self.pools[width] = pool
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
                old, pool = pool, self.make_pool(slots, pool.width, len(self.layers))
                pool.move(old)
                del old
                shrunk = True
            if pool is None:
                del self.pools[width]
            else:
                self.pools[width] = pool
        if shrunk:
            _free_cache()
        live = {id(r) for g in [*self.pools.values(), *self.prefills.values()] for r in g.rows if r is not None}
        for rid in [rid for rid, r in self.rows.items() if r.finish is not None and id(r) not in live]:
            state = self.rows.pop(rid)
            (self.preempted if state.finish == "preempted" else self.left).append(rid)

    def _report(self, t0, wait0, read0, compute_s, emitted, prefill_tokens, streamed, groups=0, attended=0) -> PassReport:
        left, preempted, self.left, self.preempted = self.left, self.preempted, [], []
        before, self._faults = self._faults, (now := memory.process_memory())
        return PassReport(
            index=self.passes, emitted=emitted,
            decode_rows=sum(len(p.live) for p in self.pools.values()),
            prefill_tokens=prefill_tokens, prefill_groups=groups, prefill_context=attended, seconds=time.perf_counter() - t0,
            wait_s=self._reader_s("wait_s") - wait0, read_s=self._reader_s("read_s") - read0, compute_s=compute_s,
            bytes_streamed=streamed, active_memory=mx.get_active_memory(),
            peak_memory=mx.get_peak_memory(), left=left, preempted=preempted,
            cache_memory=mx.get_cache_memory(), reader_memory=self.reader.buffer_bytes if self.reader else 0,
            rss=now.rss, cgroup_usage=memory.cgroup_usage(), minor_faults=now.minor_faults - before.minor_faults,
            major_faults=now.major_faults - before.major_faults)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
