"""The end of a pass for the rows at the end of their input: each drawn token taken into its row's state
(`accept`: EOS, max_tokens), which a pipeline stage without the head does alone (`speculate.draw` draws them)."""

from .groups import RowState
from .records import Emitted


def rows_of(emitting) -> list[RowState]:
    """The rows sampled this pass, in the order `draw` takes them: group by group, each group's `sampled` rows."""
    return [r for g, _ in emitting for r in g.sampled()[1]]


def taken(rows: list[RowState], tokens) -> list[Emitted]:
    """`accept`'s tokens in the rows' order: what a stage without the head emits of the last stage's tokens."""
    out = accept(rows, tokens)
    return [e for j in sorted(out) for e in out[j]]


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
