"""Decode pools whose K and V are stored quantized, in MLX's affine format (`--kv-bits 8|4`).

A QuantPool is a Pool (groups.py: a slot per row, a token written at column len each pass) whose every
layer holds K and V as three arrays each, one entry per (slot, head, column), each token quantized on its own:

    packed  [slots, heads, width, head_dim x bits / 32]  uint32   head_dim values of a token, bits each
    scales  [slots, heads, width, head_dim / group]      compute  one per group of `group` along head_dim
    biases  [slots, heads, width, head_dim / group]      compute  value = packed x scale + bias

A token's groups run along its own head_dim, so writing a token never touches another's: a pass's chunk of T
tokens (its last token and its drafts, speculate.py) is stored as T tokens written one at a time would be. A joining
row's prompt KV (computed unquantized by its prefill group) is quantized once as it is copied into its slot, rows
moved between slots or pools are copied as stored. Attention reads a pool's live slots and columns through
`mx.quantized_matmul` (scores against packed keys, then the weighted sum of packed values), pool by pool:
nothing dequantizes a pool. `shares.kv_fields` is the layout both the allocation and admission's price read.
"""

import mlx.core as mx

from spill.errors import SpillError
from spill.typed import MAX_DRAFTS

from .attention import decode_shares
from .groups import Pool, SlotCache
from .shares import KV_GROUP_SIZES, kv_fields, plan_kv_refusal
from .streams import spread


class QuantSlotCache(SlotCache):
    """One layer's quantized K and V of a QuantPool: `keys` and `values` are (packed, scales, biases)."""

    def place(self, slot: int, keys: tuple, values: tuple) -> None:
        """A row's stored K and V (each a triple [1, heads, n, *]) into columns 0..n-1 of its slot."""
        if self.keys is None:
            self.keys, self.values = self._allocate(keys), self._allocate(values)
        n = keys[0].shape[2]
        for stores, new in ((self.keys, keys), (self.values, values)):
            for store, part in zip(stores, new):
                store[slot:slot + 1, :, :n, :] = part

    def _allocate(self, like: tuple) -> tuple:
        p = self.pool
        heads, dim = like[0].shape[1], like[0].shape[3] * 32 // p.bits
        fields = kv_fields(dim, like[1].dtype.size, p.bits, p.group_size)
        return tuple(mx.zeros((p.slots, heads, p.width, n), x.dtype) for (n, _), x in zip(fields.values(), like))

    def admit(self, slot: int, keys: mx.array, values: mx.array) -> None:
        """A joining row's prompt KV [1, heads, n, head_dim], quantized once."""
        self.place(slot, self._quantize(keys), self._quantize(values))

    def _quantize(self, x: mx.array) -> tuple:
        return tuple(mx.quantize(x, group_size=self.pool.group_size, bits=self.pool.bits))

    def take(self, slot: int, n: int) -> tuple:
        return tuple(tuple(mx.contiguous(x[slot:slot + 1, :, :n, :]) for x in kv) for kv in (self.keys, self.values))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys [used, heads, T, head_dim] of this pass, quantized and written at columns len..len+T-1 of each slot."""
        p = self.pool

        def put(stores, new):
            out = []
            for store, part in zip(stores, self._quantize(new)):
                if part.shape[0] < p.slots:   # unused slots past the last row: a write to their column 0
                    part = mx.concatenate([part, mx.zeros((p.slots - part.shape[0], *part.shape[1:]), part.dtype)])
                out.append(mx.put_along_axis(store, mx.broadcast_to(p.write_at, part.shape), part, axis=2))
            return tuple(out)
        self.keys, self.values = put(self.keys, keys), put(self.values, values)
        return self.fetched()

    def fetched(self) -> tuple[tuple, tuple]:
        p = self.pool
        return tuple(x[:p.used, :, :p.span, :] for x in self.keys), tuple(x[:p.used, :, :p.span, :] for x in self.values)


class QuantPool(Pool):
    """A decode pool with K and V quantized to `bits` in groups of `group_size` (see the module docstring)."""

    slot_cache = QuantSlotCache

    def __init__(self, slots: int, width: int, layers: int, *, bits: int, group_size: int):
        self.bits, self.group_size = bits, group_size
        super().__init__(slots, width, layers)

    @staticmethod
    def attend(cache, queries, scale, mask, sinks, streams) -> mx.array:
        """A JointCache's attention (queries [rows, heads, T, head_dim], T the pass's chunk), each pool over its own
        span, a pool of enough rows split by rows over the CPU streams."""
        if sinks is not None:
            raise SpillError("this model's attention uses sinks, which quantized KV cannot take; leave --kv-bits out")
        out, start = [], 0
        for p, c in zip(cache.pools, cache.parts):
            (k, v), rows = c.fetched(), slice(start, start + p.used)
            q, m = queries[rows], mask[rows, ..., :k[0].shape[2]]

            def part(a, b, q=q, k=k, v=v, m=m, p=p):
                cut = lambda t: tuple(x[a:b] for x in t)
                return quantized_attention(q[a:b], cut(k), cut(v), scale, m[a:b], p.bits, p.group_size)
            n = min(decode_shares(p.used), len(streams))
            out.append(spread(streams[:n], p.used, part) if n > 1 else part(0, p.used))
            start += p.used
        return out[0] if len(out) == 1 else mx.concatenate(out)


def quantized_attention(queries, keys: tuple, values: tuple, scale: float, mask, bits: int, group_size: int):
    """Attention of queries [B, heads, L, D] over quantized keys and values ([B, kv_heads, S, *] each), grouped
    queries sharing their KV head; mask [B, 1, L or 1, S] of booleans."""
    b, heads, length, dim = queries.shape
    kv = keys[0].shape[1]
    q = (queries * scale).reshape(b, kv, heads // kv, length, dim)
    if mx.default_device() == mx.gpu:   # MLX 0.32's CUDA quantized matmul runs on row-contiguous packed arrays only
        keys, values = (tuple(mx.contiguous(x) for x in t) for t in (keys, values))
    k, v = (tuple(mx.expand_dims(x, 2) for x in t) for t in (keys, values))   # [B, kv, 1, S, *]
    scores = mx.quantized_matmul(q, *k, transpose=True, group_size=group_size, bits=bits)   # [B, kv, rep, L, S]
    scores = mx.where(mx.expand_dims(mask, 2), scores, mx.finfo(scores.dtype).min)
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *v, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(b, heads, length, dim)


def pool_maker(bits: int | None, group_size: int, plan, dtype=None):
    """The streamer's decode pool constructor for a KV setting and a model's load plan: Pool, or QuantPool at `bits`.
    `dtype`: the compute dtype (None: the stored one), in which the device must run the quantized attention."""
    if (why := plan_kv_refusal(bits, group_size, plan)) is not None:
        raise SpillError(why)
    if bits is None:
        return Pool
    if (why := device_refusal(bits, group_size, plan, dtype or stored_dtype(plan))) is not None:
        raise SpillError(why)
    return lambda slots, width, layers: QuantPool(slots, width, layers, bits=bits, group_size=group_size)


_RUNS: dict[tuple, str | None] = {}   # (bits, group, dtype, device, kv, heads, dim, queries) -> MLX's error or None
CHUNKS = (2, 1 + MAX_DRAFTS)   # the queries a row's chunk of drafts attends with, the fewest and the most


def device_refusal(bits: int, group_size: int, plan, dtype) -> str | None:
    """The sentence for a KV format whose attention this MLX cannot run on this device, found by running it on two
    small shapes (MLX 0.32's CUDA backend has no quantized matmul for some group sizes); None where it runs."""
    if (err := _fails(bits, group_size, plan, dtype)) is None:
        return None
    dim = plan.kv_heads_and_dim[1]
    runs = [g for g in KV_GROUP_SIZES if g != group_size and dim % g == 0 and _fails(bits, g, plan, dtype) is None]
    fix = f"use --kv-group-size {runs[0]}" if runs else "leave --kv-bits out"
    where = "GPU" if mx.default_device() == mx.gpu else "CPU"
    return (f"--kv-bits {bits} --kv-group-size {group_size}: MLX {mx.__version__} on this {where} cannot run attention "
            f"over KV in that format ({err}); {fix}")


def chunk_refusal(bits: int | None, group_size: int, plan, dtype=None) -> str | None:
    """MLX's error where this device runs a quantized pool's attention for one query a row but not for a chunk of
    drafts (queries CHUNKS); None where it runs, or the KV is unquantized. `dtype` as `pool_maker` takes it."""
    if bits is None:
        return None
    dtype = dtype or stored_dtype(plan)
    return next((err for n in CHUNKS if (err := _fails(bits, group_size, plan, dtype, n)) is not None), None)


def _fails(bits: int, group: int, plan, dtype, queries: int = 1) -> str | None:
    kv, dim = plan.kv_heads_and_dim
    heads = int(plan.config.get("num_attention_heads") or kv)
    key = (bits, group, dtype, mx.default_device(), kv, heads, dim, queries)
    if key not in _RUNS:
        _RUNS[key] = _attention_fails(bits, group, dtype, kv, heads, dim, queries)
    return _RUNS[key]


def _attention_fails(bits: int, group: int, dtype, kv: int, heads: int, dim: int, queries: int) -> str | None:
    try:
        for rows, tokens in ((1, 2 + queries), (48, 130)):   # a pool's live columns: a slice of its wider arrays
            stored = tuple(x[:, :, :tokens] for x in mx.quantize(mx.zeros((rows, kv, tokens + 5, dim), dtype),
                                                                 group_size=group, bits=bits))
            mask = mx.ones((rows, 1, queries, tokens), mx.bool_)
            q = mx.zeros((rows, heads, queries, dim), dtype)
            mx.eval(quantized_attention(q, stored, stored, 1.0, mask, bits, group))
    except (RuntimeError, ValueError) as err:
        return str(err).splitlines()[0][:200]
    return None


def stored_dtype(plan):
    """The floating dtype most of a model's tensors are stored in (a quantized model's: its scales')."""
    codes = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}
    seen = [t.dtype for layer in plan.layers for t in layer if t.dtype in codes] + [t.dtype for t in plan.resident
                                                                                   if t.dtype in codes]
    return codes[max(set(seen), key=seen.count)] if seen else mx.float32
