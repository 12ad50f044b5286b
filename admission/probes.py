"""The first-use probes of a model on this machine: a cold read of its weights, a timed layer (its
math, and its attention over a short and a long context) and a few real passes of the streamer.
`calibration.open_calibration` runs them once per key and stores what they measured."""

import os
import sys
import time
from pathlib import Path

import numpy as np

from spill.platform import on_cpu

from .passmodel import Observation, PassModel, read_tail
from .policy import width_class

PROBE_BYTES = 1 << 30          # the cold read probe reads at most this much of the weights
_CHUNK = 64 << 20
_F_NOCACHE = 48                # macOS fcntl: reads bypass the unified buffer cache


def weight_files(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def read_probe(files: list[Path], limit: int = PROBE_BYTES) -> float:
    """Cold sequential read bandwidth in bytes/s: each file's pages are dropped from the page cache
    first and behind every read (as the streamer's reader does), so a model that was just read
    cannot pose as a streaming rate."""
    buf = bytearray(_CHUNK)
    done, seconds = 0, 0.0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            _drop(fd, 0, 0)
            if sys.platform == "darwin":
                import fcntl
                fcntl.fcntl(fd, _F_NOCACHE, 1)
            pos, t0 = 0, time.perf_counter()
            while done < limit:
                n = os.preadv(fd, [memoryview(buf)[:min(_CHUNK, limit - done)]], pos)
                if n <= 0:
                    break
                _drop(fd, pos, n)
                pos, done = pos + n, done + n
            seconds += time.perf_counter() - t0
        finally:
            os.close(fd)
        if done >= limit:
            break
    return done / seconds if seconds > 0 else float("inf")


def _drop(fd: int, offset: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def compute_probe(plan, dtype, kv: tuple | None = None) -> PassModel:
    """Time the model's first layer as the streamer runs it (its weights, its attention, in the
    compute dtype): a 128-token prefill, then decode steps of 1, 2 and 16 rows, scaled to every
    layer, its attention per token of context (`_attention_per_token`), a prompt token's per key it scores
    (`_keys_per_token`) and another prefill group beside the decode rows beyond its tokens (`_group_cost`); the
    head per row priced from a matmul of the model's width; what 2 rows cost beyond one (a CPU packs weights
    for a product) is its own term. A layer that cannot run here leaves the matmul's figures alone."""
    import mlx.core as mx
    c = plan.config
    h, n = int(c.get("hidden_size", 1024)), int(c.get("num_hidden_layers", 1))
    fixed_per_param, row_per_param = _matmul_rates(h, dtype)
    params = plan.streamed_bytes / {"BF16": 2, "F16": 2, "F32": 4}.get(_stored_dtype(plan), 2)
    head = row_per_param * h * int(c.get("vocab_size", 0))
    model = PassModel(bandwidth=1.0, fixed_s=fixed_per_param * params, per_row_s=row_per_param * params + head,
                      per_prefill_token_s=row_per_param * params, per_context_token_s=row_per_param * 2 * h * n,
                      per_product_s=fixed_per_param * params)
    try:
        from spill.streamer.families import adapter_for
        from spill.streamer.reader import WeightReader
        adapter = adapter_for(plan)
        with WeightReader(plan, dtype=dtype, read_ahead=False) as reader:
            reader.start_pass([0])
            adapter.load_layer(0, reader.take(0))
        layer = adapter.layers[0]

        def run(rows: int, tokens: int, caches) -> float:
            x = mx.random.normal((rows, tokens, h)).astype(dtype)
            mask = adapter.masks(x, caches)[0]
            mx.eval(x)
            t0 = time.perf_counter()
            mx.eval(adapter.run_layer(0, [x], [mask], caches[:1]))   # as the streamer runs it (its SwiGLU split)
            return time.perf_counter() - t0

        caches = lambda b: [adapter.make_cache(i, [0] * b) for i in range(len(adapter.layers))]
        prefill = min(run(1, 128, caches(1)) for _ in range(3))      # the first run also warms up
        one, two, many = caches(1), caches(2), caches(16)
        run(1, 128, one)
        run(2, 32, two)
        run(16, 32, many)
        d1, d2, d16 = (min(run(b, 1, c) for _ in range(3)) for b, c in ((1, one), (2, two), (16, many)))
        row = max(d16 - d2, 0.0) / 14
        packed = max(d2 - d1 - row, 0.0)      # one row is a matrix-vector product; more, a packed product
        model.fixed_s, model.packed_s = d1 * n, packed * n
        model.per_row_s = row * n + head
        keys = _keys_per_token(run, caches)                 # a prompt token's attention, per key it scores
        token = max(prefill - d1 - packed - keys * 128 * 128, 0.0) / 128
        model.per_prefill_context_s, model.per_prefill_token_s = keys * n, token * n
        try:   # what a group costs beyond its tokens, which are priced per token
            model.per_product_s = max(_group_cost(adapter, h, dtype, 32) - 32 * token - keys * 32 * 32, 0.0) * n
        except Exception:   # the rest of the layer's figures stand; another group at a lone row's price
            model.per_product_s = (d1 + packed) * n
        model.per_context_token_s = _attention_per_token(adapter, layer, h, *plan.kv_heads_and_dim, dtype,
                                                         pool=_pool_maker(plan, dtype, kv)) * n
    except Exception:   # an exotic layer: the matmul's figures stay the prior
        pass
    return model


def _keys_per_token(run, caches, chunk: int = 128, cached: int = 1024, tries: int = 5) -> float:
    """Seconds a prompt token spends on each key it scores: a `chunk` of one row after `cached` tokens of its
    prompt against the same chunk first (the mixed-length job's long prompts, priced without it: 2.2x short)."""
    def chunk_after(before: int) -> float:
        cache = caches(1)
        if before:
            run(1, before, cache)
        return run(1, chunk, cache)
    chunk_after(cached)   # warm-up
    return _beyond(lambda: chunk_after(cached), lambda: chunk_after(0), tries) / (chunk * cached)


def _beyond(slow, fast, tries: int) -> float:
    """What `slow()` takes beyond `fast()`, each the best of `tries`, timed in turn: a busy moment slows both."""
    times = [(slow(), fast()) for _ in range(tries)]
    return max(min(t for t, _ in times) - min(t for _, t in times), 0.0)


def _group_cost(adapter, h: int, dtype, chunk: int = 32) -> float:
    """Seconds layer 0 spends on one more prefill group (one row, `chunk` prompt tokens) beside 16 decoding
    rows and a first group, through the streamer's own `run_layer`: a group's own attention and its share of
    the products, not a share of the weights' trip."""
    import mlx.core as mx

    def step(groups: int) -> float:
        shapes = [(16, 1)] + [(1, chunk)] * groups
        caches = [adapter.make_cache(0, [0] * b) for b, _ in shapes]
        best = float("inf")
        for k in range(4):   # the first call allocates the caches, as a group's first pass does once
            hs = [mx.random.normal((b, t, h)).astype(dtype) for b, t in shapes]
            masks = [adapter.masks(x, [c])[0] for x, c in zip(hs, caches)]
            mx.eval(hs, [m for m in masks if isinstance(m, mx.array)])
            t0 = time.perf_counter()
            mx.eval(adapter.run_layer(0, hs, masks, caches))
            if k:
                best = min(best, time.perf_counter() - t0)
        return best

    step(1)   # warm-up
    return max(step(2) - step(1), 0.0)


def _pool_maker(plan, dtype, kv: tuple | None):
    """The decode pool the job's KV format makes (`kv`: (bits, group size), quantized; None: unquantized)."""
    from spill.streamer.kvquant import pool_maker
    return pool_maker(*(kv or (None, 64)), plan, dtype)


def _attention_per_token(adapter, layer, h: int, kv_heads: int, head_dim: int, dtype, rows: int = 16, short: int = 64,
                         long: int = 1024, tries: int = 5, pool=None) -> float:
    """Seconds a decode step of `layer` spends per token of context its rows attend to, through the engine's
    own KV pool: `rows` rows at `long` tokens of context against the same rows at `short` (a matmul's rate
    prices it two orders of magnitude low: attention is dispatch and softmax, not products). `pool`: the decode pool's
    constructor (quantized KV attends through other kernels)."""
    import mlx.core as mx
    make = pool
    from spill.streamer.core import Row
    from spill.streamer.groups import Decode, Pool, RowState

    def pool_at(context: int) -> Decode:
        pool = (make or Pool)(rows, long + 1, 1)
        kv = mx.random.normal((1, kv_heads, context, head_dim)).astype(dtype)
        for s in range(rows):
            pool.rows[s] = RowState(Row(s, [0] * context, 1), None)
            pool.rows[s].tokens.append(0)
            pool.caches[0].admit(s, kv, kv)
            pool.lens[s] = context
        return Decode([pool], 1)

    def step(decode: Decode) -> float:   # each step writes the same column: the context stays as it was
        decode.next_tokens(1)
        x = mx.random.normal((rows, 1, h)).astype(dtype)
        mask = adapter.masks(x, decode.caches)[0]
        mx.eval(x, mask)
        t0 = time.perf_counter()
        mx.eval(layer(x, mask, cache=decode.caches[0]))
        return time.perf_counter() - t0

    near, far = pool_at(short), pool_at(long)
    step(near), step(far)   # warm-up
    return _beyond(lambda: step(far), lambda: step(near), tries) / (rows * (long - short))


PROBE_ROWS = 16   # the pass probe's decode batch, and the least it runs at
PROBE_MOST = 128  # the widest: its prefill carries 16 tokens a row (2,048 here, ~8x the 16 rows' pass)
WIDE_STEPS = 3    # timed decode steps at a batch wider than 16: one moved a fit of narrower passes little


def probe_batch(rows: int) -> int:
    """The widest decode batch the pass probe runs for a job whose budget holds `rows` at once."""
    return max(PROBE_ROWS, min(int(rows), PROBE_MOST))


def pass_probe(folder, dtype, kv: tuple | None = None, rows: int = PROBE_ROWS) -> list[Observation]:
    """Real passes of the streamer, the weights dropped from the page cache first: `probe_batch(rows)` short
    prompts prefilled together, a decode step of all of them (WIDE_STEPS more where that is wider than 16),
    then one of 16 rows, then one of a single row. The first decode warms up and is not returned (on the demo
    model it cost 2.5x the second); on a GPU a prefill of rows that end with it goes first (a fresh H200's first
    prefill cost ~100x the next: MLX compiles its kernels at first use; on the CPU the two cost the same). They
    hold what a pass costs beyond its layers' math (loading each layer, the head and sampling, products over
    weights just read), up to the batch the job's budget runs: its rows are priced where they were timed."""
    from spill.streamer.core import Row, Streamer
    for path in weight_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            _drop(fd, 0, 0)
        finally:
            os.close(fd)
    bits, group = kv or (None, 64)
    wide = probe_batch(rows)
    extra = WIDE_STEPS if wide > PROBE_ROWS else 0   # decode steps of the whole batch before the 16 rows'
    streamer = Streamer(folder, dtype=dtype, prefill_chunk=64, kv_bits=bits, kv_group_size=group)
    # the rows' pool as admission reserves one (`wide` slots of their width class), not an unreserved pool's spare
    # slots of 256 tokens: those held 9x the KV the job's budget priced, and the probe was OOM-killed under a cap
    width = width_class(16 + 4 + extra)
    streamer.reserve([(wide, width)])
    try:
        if not on_cpu():   # the warm-up prefill: the same shapes, rows that end with it
            for i in range(wide):
                streamer.add(Row(wide + i, list(range(1 + i, 17 + i)), 1, width=width))
            streamer.step()
        for i in range(wide):   # row 0 outlives the first 16, which outlive the rest
            streamer.add(Row(i, list(range(1 + i, 17 + i)), 2 + extra + (i < PROBE_ROWS) + (i == 0), width=width))
        shapes = [(0, 0)] + [(wide, wide * (17 + j)) for j in range(1 + extra)] + [
            (PROBE_ROWS, PROBE_ROWS * (18 + extra)), (1, 19 + extra)]
        out = []
        for decode_rows, context in shapes:
            r = streamer.step()
            out.append(Observation(decode_rows, r.prefill_tokens, context, r.bytes_streamed, r.seconds, r.wait_s,
                                   r.compute_s, r.read_s, prefill_groups=r.prefill_groups,
                                   prefill_context=r.prefill_context))
        return [out[0], *out[2:]]
    finally:
        streamer.close()


def priced_by_passes(model: PassModel, passes: list[Observation]) -> PassModel:
    """The layer probe's model with its compute terms from `pass_probe`'s passes (fixed from the lone row's; per
    row and a product's packing from the batched ones beyond it, a line through them where two batches ran, else
    the 16 rows' beyond the lone one; prefill tokens from the rest of the first; another group's cost and a prompt
    token's keys as the layer probe timed them), their overlap, overhead and read tail."""
    prefill, decodes = passes[0], sorted(passes[1:], key=lambda p: p.decode_rows)
    ctx = model.per_context_token_s
    fixed = max(decodes[0].compute_s - ctx * decodes[0].context_tokens, 1e-6)
    rows, beyond = np.array([[p.decode_rows, p.compute_s - fixed - ctx * p.context_tokens] for p in decodes[1:]]).T
    packed, row = 0.0, max(float(beyond[0] / (rows[0] - decodes[0].decode_rows)), 0.0)
    if np.ptp(rows) > 0:   # on a CPU a product packs every weight, whatever its rows: the line's intercept
        row, packed = np.polyfit(rows, beyond, 1)
        row, packed = max(float(row), 0.0), max(float(packed), 0.0)
    overhead = float(np.median([max(p.seconds - p.wait_s - p.compute_s, 0.0) for p in passes]))
    hidden = [1.0 - (p.seconds - overhead - max(p.read_s, p.compute_s)) / min(p.read_s, p.compute_s)
              for p in passes if min(p.read_s, p.compute_s) > 0]
    keys = model.per_prefill_context_s * prefill.prefill_context      # the prompts' attention, priced apart
    token = max(prefill.compute_s - fixed - packed - keys, 0.0) / max(prefill.prefill_tokens, 1)
    return PassModel(model.bandwidth, fixed, packed, row, token, ctx, model.per_product_s, model.per_prefill_context_s,
                     overlap=float(np.clip(np.median(hidden), 0.0, 1.0)) if hidden else model.overlap,
                     overhead_s=overhead, read_tail_s=read_tail(passes, overhead, least=1))


def _matmul_rates(h: int, dtype) -> tuple[float, float]:
    """Seconds per weight of an [h, h] matmul in `dtype`: for one row (the weights' trip through
    memory) and for each further row of a 256-row batch."""
    import mlx.core as mx
    w = mx.random.normal((h, h)).astype(dtype)
    one, many = mx.random.normal((1, h)).astype(dtype), mx.random.normal((256, h)).astype(dtype)
    mx.eval(w, one, many)

    def timed(x, reps=5) -> float:
        mx.eval(x @ w.T)
        t0 = time.perf_counter()
        for _ in range(reps):
            mx.eval(x @ w.T)
        return (time.perf_counter() - t0) / reps

    t1, t256 = timed(one), timed(many)
    return t1 / (h * h), max(t256 - t1, 1e-9) / 255 / (h * h)


def _stored_dtype(plan) -> str:
    return plan.layers[0][0].dtype if plan.layers and plan.layers[0] else "F32"
