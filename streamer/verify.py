"""Verification of drafts: per row, the accepted prefix of its k drafts and one token of the target's own.

A row carrying k drafts d1..dk runs through the pass as a (k+1)-token chunk [last, d1, .., dk]; the
head gives the target's logits at its k+1 positions, row after row ([N, V], N = sum of k + 1):

    row  chunk fed          logits        verdict (greedy)
    a    t  x  y  z         x  y  w  .    x y accepted, w the target's: 3 tokens, accepted 2
    b    u                  v             no drafts: one token, as without speculation

Greedy rows keep the target's argmax until the first mismatch, then the target's token (token-identical
to decoding without drafts). Sampled rows draw from the distribution `sampling.target_logits` gives the
path without drafts: a draft with the draft's distribution q is accepted with min(1, p(d) / q(d)), else the
token comes from normalize(max(p - q, 0)); a draft without one (prompt lookup: q a point mass) is accepted
with p(d), else the token comes from p with d removed. That one is drawn as the target's own token at the
position, kept as a draft's acceptance where it equals d: the same distribution, and a seeded row gives the
same text whatever lookup drafted. Every random number is a hash of (the row's seed, the output index,
a stream), so a re-run gives the same text. EOS and max_tokens end a row inside its accepted run, exactly
where it would have ended without drafts; stop strings stay the tokenizer's, which sees tokens in order.

How the pass will carry drafts (the next step, with the pools):
- Plan: per decode row an upper bound k (0: none), chosen by admission (`admission/drafts.py`: per row
  from its acceptance, per pass within the read time). The streamer proposes up to k: prompt lookup from
  the row's own history and the job's finished outputs (`streamer/lookup.py`, its index beside the
  row's tokens), or a resident draft model (tokens and their distributions q).
- Streamer: a row with k drafts runs [last, d1..dk] over its pool slot, rows padded to the pool's longest
  chunk; attention is causal within the chunk over the slot's L cached keys, and KV is written at L..L+k.
  The head runs on the valid positions only, some rows at a time (N x V floats of logits: 300 rows of
  k = 4 at a 128k vocabulary would be 770 MB); `verify` decides; the slot's length becomes
  L + accepted + 1 (the last token and the accepted drafts): rejected positions' KV lies past the length
  and is overwritten by the next chunk. Rows without drafts take the same path with k = 0, sampled ones
  too (`RowSampler` draws otherwise), so lookup drafts never change a seeded row's text.
- Report: per row the tokens it appends (packed), drafts proposed and drafts accepted, so admission keeps
  each row's acceptance (`drafts.observe`) and counts tokens per pass.
- Admission prices a row's slot at prompt + max_tokens (its drafts never pass its max_tokens, so their KV lies
  inside the slot, at the pool's bytes a token, quantized or not), and the pass with drafts as the padded chunk
  it is: rows x (1 + k) tokens (`drafts.padded`).
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .sampling import SamplingParams, target_logits

_MASK = (1 << 64) - 1


@dataclass
class Draft:
    """One row's part in a verification."""
    tokens: np.ndarray               # [k] draft token ids (k may be 0)
    params: SamplingParams
    seed: int                        # the row's seed (its own, or the streamer's for an unseeded row)
    position: int                    # tokens the row generated before: the output index of the first one decided
    left: int                        # tokens it may still generate (max_tokens - generated)
    eos_ids: frozenset = frozenset()
    probs: np.ndarray | mx.array | None = None   # [k, V] the draft's distributions; None: point masses

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        if self.probs is not None and (len(self.probs.shape) != 2 or self.probs.shape[0] != self.tokens.size):
            raise ValueError(f"draft probabilities {tuple(self.probs.shape)}: expected [{self.tokens.size}, V], "
                             "one distribution a draft token")


@dataclass
class Verdict:
    tokens: list[int]        # what the row appends, in order (EOS excluded)
    accepted: int            # drafts the rule accepted: the slot's length moves to L + accepted + 1
    finish: str | None       # "stop" (EOS), "length" (max_tokens) or None


def uniforms(seeds, indices, stream: int) -> np.ndarray:
    """Uniforms in (0, 1), one per (seed, output index), independent across streams: splitmix64 of the three."""
    s = np.atleast_1d(np.asarray(seeds))
    s = np.array([int(x) & _MASK for x in s], np.uint64) if s.dtype == object else s.astype(np.int64).astype(np.uint64)
    x = (s * np.uint64(0x9E3779B97F4A7C15)) ^ (np.asarray(indices, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03))
    x = x ^ np.uint64((stream * 0x94D049BB133111EB) & _MASK)
    for _ in range(2):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def residual(p: mx.array, q: mx.array) -> mx.array:
    """Where a draft from q was rejected, the target's token comes from normalize(max(p - q, 0))."""
    return mx.maximum(p - q, 0.0)


def verify(logits: mx.array, rows: list[Draft]) -> list[Verdict]:
    """logits [N, V]: each row's k + 1 positions in turn -> each row's verdict."""
    counts = np.array([len(r.tokens) + 1 for r in rows], dtype=np.int64)
    if logits.ndim != 2 or logits.shape[0] != counts.sum():
        raise ValueError(f"logits {tuple(logits.shape)}: expected [{counts.sum()}, V], the rows' drafts + 1 each")
    starts = np.cumsum(counts) - counts
    decided: list[tuple] = [None] * len(rows)   # per row: (the tokens decided, the drafts accepted)

    def positions(which):   # the logits of these rows' positions
        return take(logits, np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in which]))

    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:   # the target's argmax at every position
        top = np.array(mx.argmax(positions(greedy), axis=-1))
        _put(decided, greedy, _agree(top, [rows[i] for i in greedy]))
    for group in _by_params(rows, [i for i, r in enumerate(rows) if not r.params.greedy]):
        p = mx.softmax(target_logits(positions(group).astype(mx.float32), rows[group[0]].params), axis=-1)
        at = np.cumsum(counts[group]) - counts[group]    # each row's first position in p
        lookup = [j for j, i in enumerate(group) if rows[i].probs is None]
        if lookup:
            _put(decided, [group[j] for j in lookup], _lookup(p, at[lookup], [rows[group[j]] for j in lookup]))
        model = [j for j, i in enumerate(group) if rows[i].probs is not None]
        if model:
            _put(decided, [group[j] for j in model], _rejection(p, at[model], [rows[group[j]] for j in model]))
    return [cut(tokens, a, r) for (tokens, a), r in zip(decided, rows)]


def cut(tokens, accepted: int, row: Draft) -> Verdict:
    """The decided tokens as the row takes them: up to EOS (excluded) or its last allowed token."""
    out = []
    for t in (int(t) for t in tokens):
        if t in row.eos_ids:
            return Verdict(out, accepted, "stop")
        out.append(t)
        if len(out) >= row.left:
            return Verdict(out, accepted, "length")
    return Verdict(out, accepted, None)


def _put(decided: list, which: list[int], verdicts: list) -> None:
    for i, v in zip(which, verdicts):
        decided[i] = v


def _by_params(rows, which) -> list[list[int]]:
    """Rows of equal sampling parameters together: one filtering of all their positions."""
    groups: dict[tuple, list[int]] = {}
    for i in which:
        p = rows[i].params
        groups.setdefault((p.temperature, p.top_p, p.top_k), []).append(i)
    return list(groups.values())


def _agree(targets: np.ndarray, rows: list[Draft]) -> list[tuple[list[int], int]]:
    """targets: the target's token at each row's k + 1 positions in turn; a row keeps its drafts while they
    equal the target's, then takes the target's token where they first differ (or after the last)."""
    out, off = [], 0
    for r in rows:
        k = len(r.tokens)
        t = targets[off:off + k + 1]
        off += k + 1
        miss = np.flatnonzero(t[:k] != r.tokens)
        a = int(miss[0]) if miss.size else k
        out.append((t[:a + 1].tolist(), a))
    return out


def _lookup(p: mx.array, at: np.ndarray, rows: list[Draft]) -> list[tuple[list[int], int]]:
    """Drafts as point masses: the target's own draw at each of a row's k + 1 positions, its drafts kept while
    they equal it. A draft is kept with p(d); else the token is p's draw given it is not d."""
    n = np.array([len(r.tokens) + 1 for r in rows])
    within = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
    index = np.repeat([r.position for r in rows], n) + within
    own = draw(take(p, np.repeat(at, n) + within), uniforms(np.repeat([r.seed for r in rows], n), index, 1))
    return _agree(own, rows)


def _rejection(p: mx.array, at: np.ndarray, rows: list[Draft]) -> list[tuple[list[int], int]]:
    """Drafts with their distributions q: each accepted with min(1, p(d) / q(d)) in turn; at the first
    rejection the row's token comes from `residual`, after k acceptances from p. `at`: each row's first row of p."""
    k = np.array([len(r.tokens) for r in rows], dtype=np.int64)
    if not k.any():
        own = draw(p[mx.array(at)], uniforms([r.seed for r in rows], [r.position for r in rows], 1))
        return [([t], 0) for t in own.tolist()]
    within = np.concatenate([np.arange(n) for n in k])
    drafts = mx.array(np.concatenate([r.tokens for r in rows]).astype(np.int32))[:, None]
    q = mx.concatenate([mx.array(r.probs) for r in rows]).astype(mx.float32)   # [sum k, V]
    p_d = mx.take_along_axis(p[mx.array(np.repeat(at, k) + within)], drafts, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, drafts, axis=-1)[:, 0]
    seeds = np.repeat([r.seed for r in rows], k)
    ok = uniforms(seeds, np.repeat([r.position for r in rows], k) + within, 0) * np.array(q_d) < np.array(p_d)
    ends = np.cumsum(k)
    accepted, some = k.copy(), k > 0   # the first rejection of each row, or all k accepted
    accepted[some] = np.minimum.reduceat(np.where(ok, np.repeat(k, k), within), (ends - k)[some])
    dist = p[mx.array(at + accepted)]
    rejected = np.flatnonzero(accepted < k)
    if rejected.size:
        first = dist[mx.array(rejected)]
        rest = residual(first, q[mx.array((ends - k + accepted)[rejected])])
        dist[mx.array(rejected)] = mx.where(rest.sum(axis=-1, keepdims=True) > 0, rest, first)
    own = draw(dist, uniforms([r.seed for r in rows], np.array([r.position for r in rows]) + accepted, 1))
    return [(r.tokens[:a].tolist() + [t], a) for r, a, t in zip(rows, accepted.tolist(), own.tolist())]


def take(x: mx.array, rows) -> mx.array:
    """x's rows at `rows`: x itself where they are all of them in order (no copy of [N, V])."""
    if rows.size == x.shape[0] and (rows == np.arange(rows.size)).all():
        return x
    return x[mx.array(rows)]


def draw(dist: mx.array, v: np.ndarray) -> np.ndarray:
    """One token from each row of dist [n, V] (unnormalized, non-negative), by its uniform in (0, 1)."""
    cdf = mx.cumsum(dist.astype(mx.float32), axis=-1)
    v = np.minimum(v, 1.0 - 2.0 ** -24).astype(np.float32)   # below the total even in float32
    below = cdf < (mx.array(v) * cdf[:, -1])[:, None]
    return np.minimum(np.array(below.sum(axis=-1)), dist.shape[-1] - 1).astype(np.int64)
