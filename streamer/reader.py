"""The weight reader: streams each layer's bytes from disk with explicit positional reads into reusable buffers
(two below; one on the CPU, `platform.read_slots`), turns them into finished mx.arrays, and hands them to the compute
thread in the pass's order. Never mmap: the page cache must not compete with the engine for memory. With read_ahead,
two threads work ahead of the compute thread (each step of theirs guarded: an error reaches take(), never a hang):

    read thread     read 0 > buf0 | read 1 > buf1 | read 2 > buf0 | read 3 > buf1 | ...
    convert thread        conv 0  |         conv 1 |         conv 2 |    ...
    compute thread            take(0), layer 0    | take(1), layer 1| take(2) ...

A buffer is refilled only once its layer is converted; a layer is converted only once the previous one was taken,
so at most two layers of mx.arrays are alive (the one computing, the one ready); with `in_flight` 1, only once the
previous one was released: one layer alive (platform.layers_in_flight). Buffers (`into`, platform.read_into): "mlx",
MLX memory, a tensor stored as computed a view of it, lent to its layer until the compute thread `release`s it, then
read into again; "buffers", the reader's own, copied out; "pinned" (a CUDA GPU), its own, page-locked, each layer
copied by the GPU into MLX memory lent as with "mlx". Floating tensors are cast to `dtype` in MLX. A layer is read
as runs of whole pages, in chunks on `read_threads` (O_DIRECT where allowed: no page cache at all; pages.py), and
its tensors converted on `convert_threads`."""

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from spill import config
from spill.errors import SpillError
from spill.platform import read_into, read_slots, recycles_layers

from . import gpu_copy
from .mlx_buffers import gpu_buffer, host_buffer, raise_cache_limit
from .pages import Span, aligned_buffer, layout, open_direct, open_file
from .plan import ModelPlan
from .tensors import Tensors

_CHUNK = 16 << 20       # bytes per read call; the page cache holds at most a few of these


class WeightReader:
    def __init__(self, plan: ModelPlan, *, dtype: "mx.Dtype | None" = None, read_ahead: bool = True,
                 drop_cache: bool = True, read_threads: int | None = None, convert_threads: int | None = None,
                 direct: bool | None = None, into: str | None = None, engine=None, in_flight: int = 2):
        self.plan, self.read_ahead, self.drop_cache = plan, read_ahead, drop_cache
        self.in_flight = in_flight    # layers of arrays alive: 1 waits for `release`, so a caller that keeps layers sets 2
        # one fd per shard, kept open; O_DIRECT only where every shard allows it
        paths = sorted({t.path for t in plan.resident} | {t.path for layer in plan.layers for t in layer})
        direct = (config.direct_io() if direct is None else direct) and drop_cache   # O_DIRECT never caches
        self._fds = open_direct(paths) if direct else None
        self.direct, self._fds = self._fds is not None, self._fds or {p: open_file(p, drop_cache) for p in paths}
        n_read = read_threads or config.read_threads()
        n_conv = self.convert_threads = convert_threads or config.convert_threads()
        self._read_pool = ThreadPoolExecutor(n_read, "spill-read") if n_read > 1 else None
        self._conv_pool = ThreadPoolExecutor(n_conv, "spill-convert") if n_conv > 1 else None
        # per layer, where each tensor goes in a buffer: (tensor, its position), spans, bytes
        self._layout = [layout(layer) for layer in plan.layers]
        self._size = max((end for _, _, end in self._layout), default=0)   # buffers fit the largest layer
        self._place(into or read_into(), engine, read_ahead, dtype)
        self._recycle = recycles_layers(self.into)   # released layers' memory is read (or copied) into again
        self.slot_bytes = self._size * len(self._bufs)   # read into at once: the reader's own buffers or MLX memory
        self.buffer_bytes = 0 if self.into == "mlx" else self.slot_bytes   # the reader's own (MLX's is MLX memory)
        raise_cache_limit(plan, dtype, self._recycle)
        # pass state, guarded by _cv; positions index the pass's order
        self._cv = threading.Condition()
        self._gen, self._order = 0, []   # _gen: bumped by start_pass and close, so stale work is dropped
        self._taken = self._next_read = self._next_conv = self._released = 0   # positions taken, read, converted, released
        self._filled: dict[int, int] = {}          # position -> buffer holding it, not yet converted
        self._ready: dict[int, dict] = {}          # position -> its converted tensors
        self._free = [True] * len(self._bufs)
        self._lent: dict[int, tuple] = {}          # position -> the MLX buffer its (taken or ready) layer views
        self._spare: list[tuple] = []              # buffers of released layers: read into again, no zero fill
        self.buffers_made = 0                      # MLX buffers allocated (and zero-filled) for reads
        self._busy, self._error = 0, None   # IO-side threads inside a job; (position, error) for take() to raise
        self._dead: RuntimeError | None = None    # an IO-side thread stopped: take() and start_pass raise it
        self._stats = {"bytes_read": 0, "read_s": 0.0, "wait_s": 0.0, "convert_s": 0.0, "layers": 0}
        # the read and convert threads, once started; SPILL_TEST_READ_RATE, a slow disk's bytes/s (0: none)
        self._closed, self._threads, self._rate = False, [], config.test_read_rate()

    def _place(self, into: str, engine, read_ahead: bool, dtype) -> None:
        """The read slots' buffers and where each layer's tensors sit; "pinned" is "buffers" where CUDA will not pin."""
        self._bufs = [(None, None) if into == "mlx" else (aligned_buffer(self._size), None)   # (numpy view, its MLX owner)
                      for _ in range(read_slots() if read_ahead else 1)]
        self._engine = gpu_copy.pinned(engine or gpu_copy.engine(), self._bufs) if into == "pinned" else None
        self.into = "buffers" if into == "pinned" and self._engine is None else into
        self.tensors = Tensors(dtype, self.into, 256 if mx.default_device() == mx.gpu else 1,
                               mx.cpu if self._engine else None)
        # per layer, (tensor, position read, position viewed): "pinned" places each at 256 bytes (gpu_copy.placed)
        self._placed = [gpu_copy.placed(lay[0]) if self._engine else [(t, p, p) for t, p in lay[0]] for lay in self._layout]
        self._views = [any(self.tensors.viewed(t, at) for t, _, at in placed) for placed in self._placed]   # per layer
        self._placed_size = max((at + t.nbytes for placed in self._placed for t, _, at in placed), default=0)

    # -- the interface ------------------------------------------------------------------------------
    def read_resident(self) -> dict[str, mx.array]:
        """Every tensor outside the layers, read once through a staging buffer of the largest one."""
        out = {}
        for spec in self.plan.resident:
            [(_, pos)], spans, size = layout([spec])
            self._read_spans(spans, staging := aligned_buffer(size), gen=None)
            out[spec.name] = self.tensors.convert(spec, staging, pos)
        self._drop_files()
        return out

    def start_pass(self, order: list[int] | None = None) -> None:
        """Set the layers of this pass (default all, in order) and start reading the first; one in flight is abandoned."""
        n = len(self.plan.layers)
        order = list(range(n)) if order is None else [int(i) for i in order]
        bad = [i for i in order if not 0 <= i < n]
        if bad:
            raise ValueError(f"start_pass: layers {bad} are out of range 0-{n - 1}")
        with self._cv:
            if self._closed:
                raise RuntimeError("start_pass on a closed WeightReader")
            self._gen += 1
            self._cv.notify_all()
            while self._busy and not self._dead:   # let stale jobs notice the new generation and stop
                self._cv.wait()
            if self._dead:
                raise self._dead
            self._order, self._taken, self._next_read, self._next_conv, self._released = order, 0, 0, 0, 0
            self._filled, self._ready, self._error, self._lent = {}, {}, None, {}   # unreleased: never reused
            self._free = [True] * len(self._bufs)
            if self.read_ahead and not self._threads:
                self._threads = [threading.Thread(target=self._guarded, args=(f, name), name=name, daemon=True)
                                 for f, name in ((self._read_loop, "spill-read"), (self._convert_loop, "spill-convert"))]
                for t in self._threads:
                    t.start()
            self._cv.notify_all()

    def take(self, i: int) -> dict[str, mx.array]:
        """Layer i's tensors, name -> evaluated mx.array, once ready; layers are taken in the pass's order."""
        t0 = time.perf_counter()
        with self._cv:
            pos = self._taken
            if pos >= len(self._order):
                raise RuntimeError(f"take({i}): no layer left in this pass; call start_pass() first")
            if self._order[pos] != i:
                raise RuntimeError(f"take({i}): layers are taken in the pass's order, the next one is {self._order[pos]}")
            self._lent = {p: b for p, b in self._lent.items() if p >= pos}   # not released: left to its views
            self._released = max(self._released, pos)   # asked for: copied now even where the caller keeps layers
            self._cv.notify_all()
            if self.read_ahead:
                while pos not in self._ready and not self._failed(pos) and not self._closed and not self._dead:
                    self._cv.wait()
                if pos not in self._ready:
                    closed = RuntimeError(f"take({i}) on a closed WeightReader")
                    raise closed if self._closed else self._dead or self._error[1]
                out = self._ready.pop(pos)
                self._taken += 1
                self._cv.notify_all()
        if not self.read_ahead:          # serial IO: read and convert here
            self._bufs[0] = self._buffer(self._bufs[0])
            self._read_spans(self._layout[i][1], self._bufs[0][0], gen=None)
            out = self._convert_layer(i, 0, gen=None)
            self._renew(0, self._taken, i)
            self._taken += 1
            if self._taken == len(self._order):
                self._drop_files()
        with self._cv:
            self._stats["wait_s"] += time.perf_counter() - t0
            self._stats["layers"] += 1
        return out

    def release(self, i: int) -> None:
        """The caller holds nothing of layer i's tensors any more (computed, evaluated and dropped): the MLX
        memory it was read into takes a later layer as it is. Only the layer taken last can be released."""
        with self._cv:
            pos = self._taken - 1
            if pos >= 0 and self._order[pos] == i:
                self._released = pos + 1
                self._spare += [self._lent.pop(pos)] if pos in self._lent else []
                self._cv.notify_all()

    def stats(self) -> dict:
        """Cumulative: bytes_read, read_s (in reads), wait_s (in take()), convert_s, layers (taken)."""
        with self._cv:
            return dict(self._stats)

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed, self._gen = True, self._gen + 1
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        for pool in filter(None, (self._read_pool, self._conv_pool)):
            pool.shutdown()
        self._drop_files()
        for fd in self._fds.values():
            os.close(fd)
        for buf, _ in self._bufs if self._engine else ():
            self._engine.unpin(buf)
        self._fds, self._bufs = {}, []

    def __enter__(self) -> "WeightReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the IO-side threads --------------------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not (
                        self._error is None and self._next_read < len(self._order)
                        and self._free[self._next_read % len(self._bufs)]):
                    self._cv.wait()
                if self._closed:
                    return
                gen, pos, slot = self._gen, self._next_read, self._next_read % len(self._bufs)
                layer = self._order[pos]
                self._free[slot] = False
                self._next_read += 1
                self._busy += 1
            def read():
                self._bufs[slot] = self._buffer(self._bufs[slot])
                done = self._read_spans(self._layout[layer][1], self._bufs[slot][0], gen)
                if pos == len(self._order) - 1:
                    self._drop_files()
                return done
            done = self._job(gen, pos, read)
            with self._cv:
                if done and gen == self._gen:
                    self._filled[pos] = slot
                self._busy -= 1
                self._cv.notify_all()

    def _convert_loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not (
                        not self._failed(self._next_conv) and self._next_conv in self._filled
                        and (self._taken if self.in_flight > 1 else self._released) >= self._next_conv):
                    self._cv.wait()
                if self._closed:
                    return
                gen, pos = self._gen, self._next_conv
                slot, layer = self._filled.pop(pos), self._order[pos]
                self._busy += 1
            def convert():
                out = self._convert_layer(layer, slot, gen)
                if out is not None:   # the slot's next buffer; start_pass waits for this job before reusing slots
                    self._renew(slot, pos, layer)
                return out
            out = self._job(gen, pos, convert)
            with self._cv:
                if out is not None and gen == self._gen:
                    self._ready[pos] = out
                    self._free[slot] = True
                    self._next_conv += 1
                self._busy -= 1
                self._cv.notify_all()

    def _guarded(self, loop, name: str) -> None:
        """A read or convert loop; where it stops on an error outside any one job, take() and start_pass say so."""
        try:
            loop()
        except BaseException as err:  # noqa: BLE001 - raised on the compute thread
            with self._cv:
                self._dead = RuntimeError(f"the weight reader's {name} thread stopped ({type(err).__name__}: {err})")
                self._dead.__cause__ = err
                self._cv.notify_all()

    def _job(self, gen: int, pos: int, work):
        """Run one read or convert; an error is kept for take() of that position (the layers before it are delivered)."""
        try:
            return work()
        except BaseException as err:  # noqa: BLE001 - re-raised on the compute thread
            with self._cv:
                if gen == self._gen and (self._error is None or pos < self._error[0]):
                    self._error = (pos, err)
            return None

    def _failed(self, pos: int) -> bool:
        return self._error is not None and self._error[0] <= pos

    # -- reading and converting ------------------------------------------------------------------------
    def _read_spans(self, spans: list["Span"], buf: np.ndarray, gen: int | None) -> bool:
        """Whole pages of each span into the buffer, in chunks (on the read threads, if several); False if abandoned."""
        jobs = [(sp, k, min(_CHUNK, sp.length - k)) for sp in spans for k in range(0, sp.length, _CHUNK)]
        t0 = time.perf_counter()
        read = lambda job: self._read_chunk(*job, buf, gen)   # noqa: E731
        got = list(map(read, jobs) if self._read_pool is None or len(jobs) == 1 else self._read_pool.map(read, jobs))
        if any(g is None for g in got):
            return False
        nbytes = sum(t.nbytes for sp in spans for t in sp.tensors)
        time.sleep(max(nbytes / self._rate - (time.perf_counter() - t0), 0.0) if self._rate else 0.0)
        with self._cv:
            self._stats["bytes_read"] += nbytes
            self._stats["read_s"] += time.perf_counter() - t0
        return True

    def _read_chunk(self, sp: "Span", k: int, n: int, buf: np.ndarray, gen) -> int | None:
        """File bytes [start + k, start + k + n) of a span; None if the pass was abandoned."""
        fd, view, done = self._fds[sp.path], memoryview(buf)[sp.buf_start + k:sp.buf_start + k + n], 0
        while done < n:
            if gen is not None and gen != self._gen:
                return None
            offset = sp.file_start + k + done
            got = os.preadv(fd, [view[done:]], offset)
            if got == 0:
                if offset >= sp.data_end:
                    return done           # the page-rounded read ran past the end of the file
                spec = next(t for t in sp.tensors if t.offset + t.nbytes > offset)
                raise SpillError(f"{spec.path}: expected {spec.name} at bytes {spec.offset}-"
                                 f"{spec.offset + spec.nbytes}, found the file ending at byte {os.fstat(fd).st_size}; "
                                 "it changed after the plan was made, re-download it")
            done += got
            if offset + got >= sp.data_end:
                break                     # all the data; the rest of the last page is past the file's end
        if self.drop_cache and not self.direct and sys.platform.startswith("linux"):
            # whole pages of this chunk only: the next chunk's pages, read ahead by the kernel, stay
            os.posix_fadvise(fd, sp.file_start + k, n, os.POSIX_FADV_DONTNEED)
        return done

    def _drop_files(self) -> None:
        """Drop what the kernel read ahead past a pass's last layer (reads drop their own): else a window a file stays."""
        if self.drop_cache and sys.platform.startswith("linux"):
            for fd in self._fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _buffer(self, held: tuple) -> tuple:
        """The buffer a slot's next layer is read into: the one it holds, else MLX memory (_recycled)."""
        return held if held[0] is not None else self._recycled(lambda: host_buffer(self._size))

    def _recycled(self, make):
        """A released layer's MLX memory, else `make()`'s new one (mlx_buffers.py)."""
        with self._cv:
            if self._spare:
                return self._spare.pop()
            self.buffers_made += 1
        return make()

    def _renew(self, slot: int, pos: int, layer: int) -> None:
        """A slot once its layer is converted: the reader's own buffer is kept. MLX memory its tensors view
        is lent to the layer until `release`; the slot takes another buffer here, off the reads' path."""
        if self._engine:                      # the copy's target: lent to the layer's views, else taken again
            target, self._bufs[slot] = self._bufs[slot][1], (self._bufs[slot][0], None)
            with self._cv:
                if self._views[layer]:
                    self._lent[pos] = target
                else:
                    self._spare.append(target)
        elif self.into == "mlx":
            held, self._bufs[slot] = self._bufs[slot], (None, None)
            if self._recycle and self._views[layer]:
                with self._cv:
                    self._lent[pos] = held
            elif self._recycle:               # copied or cast: nothing views it
                self._bufs[slot] = held
            self._bufs[slot] = self._buffer(self._bufs[slot])

    def _convert_layer(self, i: int, slot: int, gen: int | None) -> dict | None:
        t0 = time.perf_counter()
        if gen is not None and gen != self._gen:
            return None
        buf, owner = self._bufs[slot]
        if self._engine:                      # each tensor to its place in MLX memory on the GPU
            owner = self._recycled(lambda: gpu_buffer(self._placed_size))
            for spec, pos, at in self._placed[i]:
                self._engine.copy(owner[2] + at, buf.ctypes.data + pos, spec.nbytes)
            self._bufs[slot] = (buf, owner)
        work = sorted(self._placed[i], key=lambda sp: -sp[0].nbytes)   # largest first: none left at the end
        convert = lambda sp: self.tensors.convert(sp[0], buf, sp[1], owner, sp[2])    # noqa: E731
        arrays = map(convert, work) if self._conv_pool is None else self._conv_pool.map(convert, work)
        done = {sp[0].name: a for sp, a in zip(work, arrays)}
        with self._cv:
            self._stats["convert_s"] += time.perf_counter() - t0
        return {spec.name: done[spec.name] for spec, _ in self._layout[i][0]}
