"""How many drafts each decode row carries through the next pass (`--speculate auto|off|K`). Pure arithmetic.

A row with per-draft acceptance a and k drafts advances (1 - a^(k+1)) / (1 - a) tokens a pass: its j-th
draft adds a^j. A draft costs what one more decode row with the row's context costs (the pass model's
per_row_s and per_context_token_s: one more token through the matmuls, attending to the row's keys).

    auto   drafts go by value per second, best first, while the pass's compute stays within its read time
           and each raises the pass's tokens per second (by `PassModel.pass_s`); a pass that is
           compute-bound already (a CPU), resident (nothing read) or uncalibrated drafts nothing
    off    none (0)
    K      up to K every pass, for tests, benchmarks and users who know their job

A row never drafts past its last token (at most max_tokens - generated - 1). Acceptance is kept per row
as a decayed count of drafts accepted over drafts tried (`observe`; a row's drafts are tried until the
first rejection), starting from PRIOR.
"""

from dataclasses import replace

import numpy as np

from .passmodel import PassModel, PassShape

AUTO_MOST = 8          # the most drafts a row carries under auto
MOST = 16              # the most `--speculate K` takes
LEAST = 0.05           # a draft less likely than this to add a token is not worth its logits
PRIOR, PRIOR_WEIGHT = 0.5, 2.0   # a new row's acceptance: 0.5, worth two drafts tried
DECAY = 0.8            # each pass that drafted keeps this much of a row's earlier counts


def parse(text: str) -> str | int:
    """`--speculate` as given: "auto", or the most drafts a row carries (0 for off)."""
    t = str(text).strip().lower()
    if t in ("auto", "off"):
        return "auto" if t == "auto" else 0
    if t.isdigit() and int(t) <= MOST:
        return int(t)
    raise ValueError(f"--speculate takes auto, off or a number of drafts from 0 to {MOST}; got {text!r}")


def observe(accepted_s: np.ndarray, tried: np.ndarray, drafted, accepted) -> tuple[np.ndarray, np.ndarray]:
    """Rows' decayed counts after a pass that drafted `drafted` and accepted `accepted` of them (arrays; rows
    that drafted nothing keep theirs). Tried: the accepted drafts, and the one rejected if any was."""
    drafted, accepted = np.asarray(drafted), np.asarray(accepted)
    took = drafted > 0
    tried_now = accepted + (accepted < drafted)
    return (np.where(took, DECAY * accepted_s + accepted, accepted_s),
            np.where(took, DECAY * tried + tried_now, tried))


def rate(accepted_s: np.ndarray, tried: np.ndarray) -> np.ndarray:
    """Per-draft acceptance from the decayed counts, the prior weighing PRIOR_WEIGHT drafts."""
    return (np.asarray(accepted_s) + PRIOR * PRIOR_WEIGHT) / (np.asarray(tried) + PRIOR_WEIGHT)


def tokens_per_row(a, k) -> np.ndarray:
    """Expected tokens a row advances in a pass with k drafts at acceptance a: 1 + a + .. + a^k."""
    a, k = np.asarray(a, dtype=float), np.asarray(k)
    return np.where(a >= 1.0, k + 1.0, (1.0 - a ** (k + 1)) / np.where(a >= 1.0, 1.0, 1.0 - a))


def priced_shape(shape: PassShape, k, contexts) -> PassShape:
    """The pass with drafts, as the pass model prices it: each draft one more decode row, attending to its
    row's context and the drafts before it."""
    k, contexts = np.asarray(k, dtype=np.int64), np.asarray(contexts, dtype=np.int64)
    return replace(shape, decode_rows=shape.decode_rows + int(k.sum()),
                   context_tokens=shape.context_tokens + int((k * contexts + k * (k + 1) // 2).sum()))


def counts(mode: str | int, model: PassModel | None, shape: PassShape, contexts, rates, left) -> np.ndarray:
    """Drafts per decoding row for the next pass. `shape`: the pass as planned without drafts (its decode rows
    these rows, its prompt tokens); `contexts`, `rates`, `left`: per row, its tokens of KV, its acceptance
    (`rate`) and the tokens it may still generate."""
    contexts, left = np.asarray(contexts, dtype=np.int64), np.asarray(left, dtype=np.int64)
    cap = np.clip(left - 1, 0, None)
    if mode != "auto":
        return np.minimum(cap, int(mode))
    out = np.zeros(len(contexts), dtype=np.int64)
    if model is None or not shape.bytes_streamed or not len(contexts):
        return out
    room = model.io_s(shape) - model.compute_s(shape)
    cap = np.minimum(cap, AUTO_MOST)
    # every (row, j-th draft) with its value a^j and its cost, best value per second first
    row = np.repeat(np.arange(len(contexts)), cap)
    j = np.arange(cap.sum()) - np.repeat(np.cumsum(cap) - cap, cap) + 1
    value = np.asarray(rates, dtype=float)[row] ** j
    cost = model.per_row_s + model.per_context_token_s * (contexts[row] + j)
    order = np.lexsort((j, -value / np.maximum(cost, 1e-12)))
    spent, tokens, seconds, drafts, keys = 0.0, float(shape.decode_rows), model.pass_s(shape), 0, 0
    for i in order:
        if value[i] < LEAST or spent + cost[i] > room:
            continue
        more = replace(shape, decode_rows=shape.decode_rows + drafts + 1,
                       context_tokens=shape.context_tokens + keys + contexts[row[i]] + j[i])
        after = model.pass_s(more)
        if (tokens + value[i]) * seconds < tokens * after:   # it would lower the pass's tokens per second
            break
        out[row[i]] += 1
        spent, tokens, seconds = spent + cost[i], tokens + value[i], after
        drafts, keys = drafts + 1, keys + int(contexts[row[i]] + j[i])
    return out
