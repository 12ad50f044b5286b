"""Attention over the decode pools, as mlx-lm's `scaled_dot_product_attention` is called from a family's module:
pool by pool (`pooled_attention`), split over CPU streams (`split_attention`), and a chunk of drafts by ops.

A decode chunk of T > 1 columns a row (speculate.py) attends with a mask, and MLX's CUDA kernel for 2 or more
queries a row makes a cuDNN plan for each shape it meets (rows, T, key columns: ~40 ms each on an H100), while a
chunk's rows and T change from pass to pass, as a draft model's first step a pass does. There
(`platform.chunk_attention`: "ops") up to BY_OPS queries a row attend by three ops, the computation MLX itself
falls back to elsewhere: no plan, and the scores [rows, heads, T, keys] are small.
"""

import mlx.core as mx

from .groups import JointCache
from .streams import cpu_streams, spread


BY_OPS = 32      # queries a row at most that attend by ops where `sdpa.ops`: a chunk of drafts, a draft model's
                 # catch-up step (draft.py); a prompt's longer chunks keep the fused kernel
DECODE_ROWS = 8   # rows of a decode step's attention each CPU stream takes at least: fewer cost more in
                  # dispatch than the split saves


def decode_shares(rows: int) -> int:
    """How many CPU streams a decode step of `rows` rows' attention may split over: DECODE_ROWS rows each."""
    return rows // DECODE_ROWS


def pooled_attention(fused):
    """mlx-lm's `scaled_dot_product_attention`, but over a JointCache of several pools pool by pool: each
    pool's rows attend over their own span, not padded to the longest row's (on a 2-core CPU, 16 rows of
    three pools spent ~1 s a pass attending over padding); split over `sdpa.split` CPU streams (split_attention),
    or, a pool too small to split, whole on the stream with the least work so far (pools side by side)."""
    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        streams = cpu_streams(sdpa.split) if sdpa.split > 1 and sinks is None else []
        if isinstance(cache, JointCache) and cache.kv_bits:   # quantized pools (kvquant.py) attend on their own
            return cache.pools[0].attend(cache, queries, scale, mask, sinks, streams)
        chunked = sdpa.ops and 1 < queries.shape[2] <= BY_OPS and sinks is None and isinstance(mask, mx.array)
        attend = by_ops if chunked else fused
        if (not isinstance(cache, JointCache) or len(cache.pools) < 2 or sinks is not None
                or not isinstance(mask, mx.array)):
            if streams and isinstance(keys, mx.array):
                return split_attention(attend, streams, queries, keys, values, cache, scale, mask)
            return attend(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        out, start, work = [], 0, [0] * len(streams)
        for p, c in zip(cache.pools, cache.parts):   # the joint mask is each pool's, padded
            k, v = c.fetched()
            rows = slice(start, start + p.used)
            m = mask[rows, ..., :k.shape[2]]
            if streams and decode_shares(p.used) < 2:
                least = work.index(min(work))
                work[least] += p.used * k.shape[2]
                with mx.stream(streams[least]):
                    out.append(attend(queries[rows], k, v, cache=None, scale=scale, mask=m))
            else:
                out.append(split_attention(attend, streams, queries[rows], k, v, None, scale, m))
            start += p.used
        return mx.concatenate(out)
    sdpa.pooled, sdpa.split, sdpa.ops = True, 1, False
    return sdpa


def split_attention(original, streams, queries, keys, values, cache, scale, mask):
    """Attention (queries [B, H, T, D], keys [B, KV, S, D]) split over MLX CPU streams: its softmax runs on one
    thread per op (at 1,024 tokens half a CPU prefill's time; 184 rows' decode at 80 tokens 3.4 ms a layer whole,
    1.8 split in two). A prompt's by rows, or by KV heads where one row; a decode step's by rows, DECODE_ROWS a
    stream at least. The same kernel on each slice, so bit for bit the whole (a split by query positions is not:
    the products' shapes change)."""
    rows, heads, kv = queries.shape[0], queries.shape[1], keys.shape[1]
    if queries.shape[2] == 1:   # a decode step: by rows, DECODE_ROWS a stream at least
        axis, n, per = 0, decode_shares(rows), 1
    elif rows > 1:
        axis, n, per = 0, rows, 1
    else:                       # one prompt: by its KV heads
        axis, n, per = 1, kv, heads // kv
    if min(n, len(streams)) < 2:
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask)
    at = axis - 4 + mask.ndim if isinstance(mask, mx.array) else -1   # the mask's own axis for it, if not broadcast

    def part(a: int, b: int) -> mx.array:
        cut, wide = (slice(None),) * axis + (slice(a, b),), (slice(None),) * axis + (slice(a * per, b * per),)
        m = mask[(slice(None),) * at + (slice(a * per, b * per),)] if at >= 0 and mask.shape[at] > 1 else mask
        return original(queries[wide], keys[cut], values[cut], cache=cache, scale=scale, mask=m)
    return spread(streams[:n], rows if axis == 0 else n, part, axis)




def by_ops(queries, keys, values, cache=None, scale: float = 1.0, mask=None, sinks=None) -> mx.array:
    """queries [B, H, T, D], keys and values [B, KV, S, D], mask [B, 1, T, S] (bool, or added): scores, softmax
    and the weighted values as three ops, each query head on its KV head (H / KV of them share one)."""
    b, heads, t, d = queries.shape
    kv = keys.shape[1]
    q = (queries * scale).reshape(b, kv, heads // kv, t, d)
    scores = q @ keys[:, :, None].swapaxes(-1, -2)   # [B, KV, H / KV, T, S]
    m = mask[:, :, None]
    scores = mx.where(m, scores, mx.finfo(scores.dtype).min) if m.dtype == mx.bool_ else scores + m
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ values[:, :, None]).reshape(b, heads, t, values.shape[-1])
