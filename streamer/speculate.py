"""Drafts verified inside the pass (`verify.py` has the rule): the decode group runs a T-token chunk per row.

A decode row the plan gives a bound k > 0 proposes up to k drafts by prompt lookup from its own history
(`lookup.History`, kept on the row's state), or from a resident draft model (`draft.py`, --draft): greedy
rows, and sampled rows of a speculating job (below). Every row of the decode pools then feeds T columns, its
last token and its drafts, padded (T = 1 + the most drafts, capped so every slot has T free columns):

    slot  len  fed (T = 3)    KV written at   position t sees    head on
    0     5    a  x  y        5 6 7           columns 0..5+t     3 positions: a, x, y
    1     3    c  .  .        3 4 5           columns 0..3+t     1 position: c (no drafts)

Positions past a row's own drafts write KV past its length, overwritten by its next chunk. After the pass a
row that drafted appends what `verify` decided and its slot's length moves to L + accepted + 1; a greedy or
teacher-fed row without drafts takes the one-token path (`sample`). Quantized pools (kvquant.py) take the chunk
as unquantized ones do, each token's K and V quantized on its own; a device whose MLX cannot attend a chunk over
quantized KV drafts nothing there (the streamer's `chunk_refusal`).

A sampled row of a speculating job (the streamer's `speculate` above 0; its `RowSampler` is `verified`) takes
every token, its first included, from `verify`'s draws, with drafts or without (k = 0): token i is the target's
draw by the uniform of (the row's seed, i), kept as a draft's acceptance where it equals the draft. Its text
depends only on its prompt, sampling parameters and seed (its own, else the streamer's fallback seed for it),
never on what lookup or a draft model drafted (a draft model's draft is its own draw by the same uniform:
`draft.py`), on its bound k or on which rows share the pass; a re-run gives the same text. It is not the text
the row gives with speculation off (`RowSampler`'s own draws), though from the same distribution.
"""

import mlx.core as mx
import numpy as np
import structlog

from .emit import accept
from .groups import Decode, RowState
from .lookup import History
from .records import Emitted
from .sampling import sample
from .verify import Draft, take, verify


def off(why: str | None, asked: int, said: set, **setting) -> bool:
    """Whether drafts are off on these pools (`why`: this device cannot attend a chunk over their quantized KV);
    an explicit --speculate K (`asked` above 0) hears it once in the log (`said`: the settings told)."""
    if why is None:
        return False
    if asked > 0 and (key := (why, *setting.values())) not in said:
        said.add(key)
        structlog.get_logger().warning("drafts off: this device cannot run attention over quantized KV for a chunk "
                                       "of drafts", speculate=asked, error=why, **setting)
    return True


def proposals(decode: Decode, bounds: dict, draft=None) -> dict[int, list[int]]:
    """id(row) -> its drafts (at least one), for the rows whose bound is above 0 and that can take them: from
    `draft` (a resident `draft.DraftModel`, --draft) where given, else by prompt lookup."""
    wanted = []
    for p in decode.pools:
        for r in p.live:
            k = min(bounds.get(r.row.id, 0), r.row.max_tokens - len(r.tokens) - 1)
            if k > 0 and r.finish is None and (r.sampler.params.greedy or r.sampler.verified) and r.row.teacher is None:
                wanted.append((r, k))
    if draft is not None:
        return draft.propose(wanted, {r.row.id for p in decode.pools for r in p.live})
    return {id(r): d for r, k in wanted if (d := _history(r).propose(k))}


def _history(r: RowState) -> History:
    """The row's prompt and tokens, indexed: made at its first drafts, extended with what it took since."""
    if r.history is None:
        r.history = History(list(r.row.prompt) + r.tokens)
    else:
        r.history.extend(r.tokens[r.history.size - len(r.row.prompt):])
    return r.history


def chunk(decode: Decode, drafts: dict[int, list[int]]) -> mx.array:
    """The decode group's input [rows, T]: each row's last token, then its drafts (cut to fit, 0-padded).
    Sets each pool's chunk, span and write columns for this pass."""
    room = min(p.width - int(p.lens[j]) for p in decode.pools for j, r in enumerate(p.rows) if r is not None)
    t = max(1, min(1 + max(map(len, drafts.values())), room))
    last = decode.next_tokens(1)   # offsets, used slots, spans of the one-token step
    fed = np.zeros((last.shape[0], t), dtype=np.int32)
    fed[:, :1] = np.array(last)
    start = 0
    for p in decode.pools:
        for j, r in enumerate(p.rows[:p.used]):
            if r is not None and id(r) in drafts:
                drafts[id(r)] = d = drafts[id(r)][:t - 1]
                fed[start + j, 1:1 + len(d)] = d
        p.chunk, p.span = t, p.span + t - 1
        at = np.pad(p.lens[:p.used], (0, p.slots - p.used))[:, None] + np.arange(t)[None, :]
        p.write_at = mx.array(at.astype(np.int32))[:, None, :, None]   # [slots, 1, T, 1]
        start += p.used
    return mx.array(fed)


def decide(adapter, decode: Decode, h: mx.array, drafts: dict[int, list[int]],
           keep_logits: bool = False) -> tuple[list[Emitted], dict]:
    """h [rows, T, D] of the chunk -> (the rows' tokens, row -> drafts accepted where it drafted), as `emit` decides
    them from each row's 1 + its drafts positions. Moves each drafting row's length on by what it accepted."""
    idx, rows = decode.sampled()
    counts = [1 + len(drafts.get(id(r), ())) for r in rows]
    logits = adapter.head(mx.concatenate([h[j, :n, :] for j, n in zip(idx, counts)])).astype(mx.float32)
    emitted, accepted = emit(logits, rows, drafts, keep_logits)
    for r in rows:
        if r.row.id in accepted:
            _advance(decode, r, accepted[r.row.id])
    return emitted, accepted


def draw(adapter, emitting, keep_logits: bool = False) -> list[Emitted]:
    """Final norm, head and a token for every row of `emitting` ((group, its hidden states) pairs), taken into
    the rows as `emit` decides them (a speculating job's sampled rows: `verify`'s seeded draws)."""
    if not emitting:
        return []
    picks = [(g.sampled(), h) for g, h in emitting]
    rows = [r for (_, rs), _ in picks for r in rs]
    logits = adapter.head(mx.concatenate([h[mx.array(idx), -1, :] for (idx, _), h in picks if idx]))
    return emit(logits.astype(mx.float32), rows, {}, keep_logits)[0]


def emit(logits: mx.array, rows: list[RowState], drafts: dict[int, list[int]],
         keep_logits: bool = False) -> tuple[list[Emitted], dict]:
    """logits [N, V]: each row's 1 + its drafts positions in turn -> (its tokens, in the rows' order; row -> drafts
    accepted where it drafted). `verify` decides a row that drafted or draws seeded, `sample` any other's one token;
    each token carries its position's logits where kept."""
    counts = [1 + len(drafts.get(id(r), ())) for r in rows]
    at = np.cumsum(counts, dtype=np.int64) - counts
    spec = [i for i, r in enumerate(rows) if id(r) in drafts or r.sampler.verified]
    plain = [i for i, r in enumerate(rows) if not (id(r) in drafts or r.sampler.verified)]
    out: dict[int, list[Emitted]] = {}
    accepted = {}
    tokens = sample(take(logits, at[plain]), [rows[i].sampler for i in plain]) if plain else []
    out.update((plain[k], e) for k, e in accept([rows[i] for i in plain], tokens).items())
    if spec:
        sel = np.concatenate([np.arange(at[i], at[i] + counts[i]) for i in spec])
        for i, taken in zip(spec, take_verified(take(logits, sel), [rows[i] for i in spec], drafts)):
            if taken is not None:
                out[i], n = taken
                if id(rows[i]) in drafts:
                    accepted[rows[i].row.id] = n
    if keep_logits:
        kept = np.array(logits)
        for i, emitted in out.items():
            for j, e in enumerate(emitted):
                e.logits = kept[at[i] + j]
    return [e for i in sorted(out) for e in out[i]], accepted


def take_verified(logits: mx.array, rows: list[RowState], drafts: dict[int, list[int]]) -> list[tuple | None]:
    """logits [N, V]: each row's 1 + its drafts positions in turn -> per row (its tokens as `verify` decided them,
    the drafts it accepted), taken into the row; None for a row ended from outside while its last step ran."""
    cases = [Draft(drafts.get(id(r), ()), r.sampler.params, r.sampler.seed, len(r.tokens),
                   r.row.max_tokens - len(r.tokens), r.row.eos_ids) for r in rows]
    out = []
    for r, v in zip(rows, verify(logits, cases)):
        if r.finish is not None:
            out.append(None)
            continue
        before = len(r.tokens)
        r.tokens += v.tokens
        r.finish = v.finish
        emitted = [Emitted(r.row.id, t, position=before + n) for n, t in enumerate(v.tokens)]
        if v.finish == "stop":
            emitted.append(Emitted(r.row.id, min(r.row.eos_ids), "stop", position=len(r.tokens)))
        elif v.finish:
            emitted[-1].finish = v.finish
        out.append((emitted, v.accepted))
    return out


def _advance(decode: Decode, r: RowState, accepted: int) -> None:
    """The slot's length past the accepted drafts (the pass already moved it one)."""
    for p in decode.pools:
        for j, s in enumerate(p.rows):
            if s is r:
                p.lens[j] += accepted
                return
