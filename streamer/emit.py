"""The end of a pass for the rows at the end of their input: the head, a token drawn for each, and each token
taken into its row's state (`accept`: EOS, max_tokens), which a pipeline stage without the head does alone."""

import mlx.core as mx
import numpy as np

from . import speculate
from .groups import RowState
from .records import Emitted
from .sampling import sample
from .verify import take


def rows_of(emitting) -> list[RowState]:
    """The rows sampled this pass, in the order `draw` takes them: group by group, each group's `sampled` rows."""
    return [r for g, _ in emitting for r in g.sampled()[1]]


def accept(rows: list[RowState], tokens) -> dict[int, list[Emitted]]:
    """Each row's drawn token taken into its state: row index -> its one Emitted (none for a row ended from
    outside while its last step ran)."""
    out = {}
    for j, (r, tok) in enumerate(zip(rows, tokens)):
        if r.finish is not None:
            continue
        position = len(r.tokens)
        r.finish = r.accept(tok)
        out[j] = [Emitted(r.row.id, tok, r.finish, None, position)]
    return out


def draw(adapter, emitting, keep_logits: bool = False) -> list[Emitted]:
    """Final norm, head and a token for every row of `emitting` ((group, its hidden states) pairs), taken into
    the rows; a speculating job's sampled rows take `verify`'s seeded draws (speculate.py)."""
    if not emitting:
        return []
    picks = [(g.sampled(), h) for g, h in emitting]
    rows = [r for (_, rs), _ in picks for r in rs]
    logits = adapter.head(mx.concatenate([h[mx.array(idx), -1, :] for (idx, _), h in picks if idx]))
    logits = logits.astype(mx.float32)
    kept = np.array(logits) if keep_logits else None
    out: dict[int, list[Emitted]] = {}   # row -> its tokens, in the rows' order
    seeded = [j for j, r in enumerate(rows) if r.sampler.verified]   # a speculating job's sampled rows
    taken = speculate.take_verified(take(logits, np.array(seeded)), [rows[j] for j in seeded], {}) if seeded else []
    out.update((j, t[0]) for j, t in zip(seeded, taken) if t is not None)
    drawn = [j for j, r in enumerate(rows) if not r.sampler.verified]
    tokens = sample(take(logits, np.array(drawn)), [rows[j].sampler for j in drawn]) if drawn else []
    out.update((drawn[k], e) for k, e in accept([rows[j] for j in drawn], tokens).items())
    if kept is not None:
        for j, emitted in out.items():
            emitted[0].logits = kept[j]
    return [e for j in sorted(out) for e in out[j]]
