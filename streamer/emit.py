"""The end of a pass for the rows at the end of their input: the head, a token drawn for each, and each token
taken into its row's state (`accept`: EOS, max_tokens), which a pipeline stage without the head does alone."""

import mlx.core as mx

from .groups import RowState
from .records import Emitted


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
    the rows as `speculate.emit` decides them (a speculating job's sampled rows: `verify`'s seeded draws)."""
    from . import speculate   # here: speculate takes `accept` from this module
    if not emitting:
        return []
    picks = [(g.sampled(), h) for g, h in emitting]
    rows = [r for (_, rs), _ in picks for r in rs]
    logits = adapter.head(mx.concatenate([h[mx.array(idx), -1, :] for (idx, _), h in picks if idx]))
    return speculate.emit(logits.astype(mx.float32), rows, {}, keep_logits)[0]
