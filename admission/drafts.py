"""How many drafts each decode row carries through the next pass (`--speculate auto|off|K`). Pure arithmetic.

A row with per-draft acceptance a and k drafts advances (1 - a^(k+1)) / (1 - a) tokens a pass: its j-th
draft adds a^j. The decode group feeds every row the same number of columns (its last token, then drafts
or padding), so a pass with a cap of c costs what (1 + c) times its decode rows cost (`padded`).

    auto   every drafting row may carry up to c drafts, c the cap that gives the pass the most tokens a second
           (`PassModel.pass_s`), priced as the streamer runs it: a (1 + c)-token chunk for every decode row; a
           row carries no draft less likely than LEAST to add a token; where compute is the pass's cost only
           rows that accept nearly everything pay for it; a resident (nothing read) or uncalibrated pass drafts nothing;
           a draft model's steps (--draft) are priced beside the pass's, so one slower than its tokens drafts nothing
    off    none (0)
    K      up to K every pass, for tests, benchmarks and users who know their job

A row never drafts past its last token (at most max_tokens - generated - 1). Acceptance is kept per row
as a decayed count of drafts accepted over drafts tried (`observe`; a row's drafts are tried until the
first rejection), starting from its prompt-length tier's measured acceptance (the calibration's), else PRIOR;
at least PROBE, so a row of a tier measured low still tries a draft or two before its own count rules it out.
"""

from dataclasses import replace

import numpy as np

from .passmodel import PassModel, PassShape
from .schedule import tier_of

AUTO_MOST = 8          # the most drafts a row carries under auto
LEAST = 0.05           # a draft less likely than this to add a token is not worth its logits
GAIN = 1.02            # drafts must raise the pass's tokens a second by this much (rates are estimates)
PRIOR, PRIOR_WEIGHT = 0.5, 2.0   # a new row's acceptance: 0.5, worth two drafts tried
PROBE = 0.1            # a row's prior is at least this: it tries a draft or so, so a tier measured low is measured again
DECAY = 0.8            # each pass that drafted keeps this much of a row's earlier counts


def observe(accepted_s: np.ndarray, tried: np.ndarray, drafted, accepted) -> tuple[np.ndarray, np.ndarray]:
    """Rows' decayed counts after a pass that drafted `drafted` and accepted `accepted` of them (arrays; rows
    that drafted nothing keep theirs). Tried: the accepted drafts, and the one rejected if any was."""
    drafted, accepted = np.asarray(drafted), np.asarray(accepted)
    took = drafted > 0
    tried_now = accepted + (accepted < drafted)
    return (np.where(took, DECAY * accepted_s + accepted, accepted_s),
            np.where(took, DECAY * tried + tried_now, tried))


def rate(accepted_s: np.ndarray, tried: np.ndarray, prior=PRIOR) -> np.ndarray:
    """Per-draft acceptance from the decayed counts, the prior (PRIOR, or each row's own; PROBE at least) weighing
    PRIOR_WEIGHT drafts."""
    prior = np.maximum(np.asarray(prior, dtype=float), PROBE)
    return (np.asarray(accepted_s) + prior * PRIOR_WEIGHT) / (np.asarray(tried) + PRIOR_WEIGHT)


def starting(tiers: dict, prompts) -> list[float]:
    """A new row's acceptance before its own drafts, for each of `prompts` (prompt tokens): its prompt-length tier's
    as measured (`tiers`), else PRIOR, not the model's: that was measured on other kinds of rows."""
    return [tiers.get(tier_of(n), PRIOR) for n in prompts]


def tokens_per_row(a, k) -> np.ndarray:
    """Expected tokens a row advances in a pass with k drafts at acceptance a: 1 + a + .. + a^k."""
    a, k = np.asarray(a, dtype=float), np.asarray(k)
    return np.where(a >= 1.0, k + 1.0, (1.0 - a ** (k + 1)) / np.where(a >= 1.0, 1.0, 1.0 - a))


def padded(shape: PassShape, columns: int) -> PassShape:
    """The pass as the streamer runs it with `columns` tokens a decode row (1: no drafts): every row's columns
    through the matmuls, the t-th attending to the row's keys and the t - 1 columns before it."""
    t, n = int(columns), shape.decode_rows
    return replace(shape, decode_rows=n * t, context_tokens=shape.context_tokens * t + n * t * (t - 1) // 2, columns=t)


def worth(rates, cap: int) -> np.ndarray:
    """Drafts per row worth carrying at most: the j-th adds a^j tokens, none below LEAST."""
    a = np.clip(np.asarray(rates, dtype=float), 1e-12, 1.0)
    j = np.floor(np.log(LEAST) / np.log(np.where(a >= 1.0, 0.5, a))).astype(np.int64)
    return np.where(a >= 1.0, cap, np.clip(j, 0, cap))


def counts(mode: str | int, model: PassModel | None, shape: PassShape, contexts, rates, left, drafter=None) -> np.ndarray:
    """Drafts per decoding row for the next pass. `shape`: the pass as planned without drafts (its decode rows
    these rows, its prompt tokens); `contexts`, `rates`, `left`: per row, its tokens of KV, its acceptance
    (`rate`) and the tokens it may still generate; `drafter`: a draft model's price (drafter.DraftCost), whose
    steps a drafting pass adds (None: prompt lookup)."""
    left = np.asarray(left, dtype=np.int64)
    cap = np.clip(left - 1, 0, None)
    if mode != "auto":
        return np.minimum(cap, int(mode))
    if model is None or not shape.bytes_streamed or not len(left):
        return np.zeros(len(left), dtype=np.int64)
    rates = np.asarray(rates, dtype=float)
    most = np.minimum(cap, worth(rates, AUTO_MOST))
    best, best_rate = np.zeros(len(left), dtype=np.int64), shape.decode_rows / model.pass_s(shape) * GAIN
    for c in range(1, int(most.max(initial=0)) + 1):
        k = np.minimum(most, c)
        steps = drafter.seconds(int((k > 0).sum()), c) if drafter is not None else 0.0
        rate = tokens_per_row(rates, k).sum() / (model.pass_s(padded(shape, 1 + c)) + steps)
        if rate > best_rate:
            best, best_rate = k, rate
    return best
