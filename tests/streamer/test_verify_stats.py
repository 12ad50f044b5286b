"""Sampled rows with drafts follow the target's distribution: many seeded rows over a six-token vocabulary,
a Markov chain as the target and a different one as the draft, and a chi-square bound on the first token
and on the second given the first. The same bound rejects a broken rule, so it cannot pass vacuously."""

from statistics import NormalDist

import mlx.core as mx
import numpy as np
import pytest

from spill.streamer import verify as verify_module
from spill.streamer.sampling import SamplingParams
from spill.streamer.verify import Draft, verify

V, ROWS = 6, 5000
P0 = np.array([0.30, 0.25, 0.15, 0.12, 0.10, 0.08])              # the target's first token
Q0 = P0[::-1].copy()                                              # the draft's: deliberately different
_rng = np.random.default_rng(0)
P = _rng.dirichlet(np.full(V, 3.0), size=V) * 0.9 + 0.1 / V      # the target's next token after each token
Q = _rng.dirichlet(np.full(V, 0.7), size=V) * 0.9 + 0.1 / V      # the draft's


def bound(df: int, alpha: float = 1e-6) -> float:
    """The chi-square value exceeded with probability alpha (Wilson-Hilferty)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def chi2(counts: np.ndarray, expected_p: np.ndarray) -> float:
    """Over the cells the target can give; a token it cannot give makes it infinite."""
    expected, can = expected_p * counts.sum(), expected_p > 0
    if counts[~can].any():
        return float("inf")
    return float(((counts[can] - expected[can]) ** 2 / expected[can]).sum())


def filtered(p: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The target as a row without drafts samples it: top_k of the untempered, then the temperature."""
    logp = np.log(p)
    if params.top_k:
        logp = np.where(logp >= np.sort(logp)[-params.top_k], logp, -np.inf)
    e = np.exp(logp / params.temperature)
    return e / e.sum()


def first_two(params: SamplingParams, with_probs: bool, k: int) -> np.ndarray:
    """ROWS rows, each decoded until it has two tokens, with k drafts a pass drawn from the draft chain;
    -> [ROWS, 2] the first two tokens of each."""
    rng = np.random.default_rng(1)
    out = [[] for _ in range(ROWS)]
    while True:
        todo = [i for i in range(ROWS) if len(out[i]) < 2]
        if not todo:
            return np.array([o[:2] for o in out])
        last = np.array([out[i][-1] if out[i] else -1 for i in todo])
        q = np.empty((len(todo), k, V))
        drafts = np.empty((len(todo), k), dtype=np.int64)
        for j in range(k):   # each draft from the draft chain, after the last token or the draft before
            q[:, j] = np.where((last < 0)[:, None], Q0, Q[last]) if j == 0 else Q[drafts[:, j - 1]]
            drafts[:, j] = (q[:, j].cumsum(axis=1) < rng.random((len(todo), 1))).sum(axis=1).clip(max=V - 1)
        logits = np.log(np.concatenate([np.where((last < 0)[:, None], P0, P[last])[:, None], P[drafts]], axis=1))
        rows = [Draft(drafts[j], params, seed=i, position=len(out[i]), left=100,
                      probs=q[j] if with_probs else None) for j, i in enumerate(todo)]
        for i, v in zip(todo, verify(mx.array(logits.reshape(-1, V).astype(np.float32)), rows)):
            out[i] += v.tokens


def statistics(params: SamplingParams, with_probs: bool, k: int = 3) -> tuple[float, float]:
    """(chi-square of the first token, of the second given the first) against the filtered target."""
    two = first_two(params, with_probs, k)
    first = np.bincount(two[:, 0], minlength=V)
    second = sum(chi2(np.bincount(two[two[:, 0] == a, 1], minlength=V), filtered(P[a], params))
                 for a in range(V) if first[a])
    return chi2(first, filtered(P0, params)), second


@pytest.mark.parametrize("params, k", [(SamplingParams(temperature=1.0), 3),
                                       (SamplingParams(temperature=0.7, top_k=4), 1)],
                         ids=["plain-3", "top_k-1"])   # k = 1: the second token is often the one after every draft
@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_model", "lookup"])
def test_sampled_rows_with_drafts_follow_the_target(params, k, with_probs):
    first, second = statistics(params, with_probs, k)
    assert first < bound(V - 1)
    assert second < bound(V * (V - 1))


def test_the_bound_rejects_a_residual_drawn_from_p(monkeypatch):
    """Broken on purpose: after a rejection the token comes from p instead of max(p - q, 0)."""
    monkeypatch.setattr(verify_module, "residual", lambda p, q: p)
    first, second = statistics(SamplingParams(temperature=1.0), True)
    assert first > bound(V - 1) and second > bound(V * (V - 1))
