"""Verification of drafts row by row: greedy rows keep the target's argmax, sampled rows its distribution
(`test_verify_stats.py`), and every row ends where it would have ended without drafts."""

import mlx.core as mx
import numpy as np
import pytest

from spill.streamer.sampling import SamplingParams
from spill.streamer.verify import Draft, uniforms, verify

V = 8
GREEDY, HOT = SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, seed=3)
CHAIN = np.log(np.random.default_rng(5).dirichlet(np.ones(V), size=V)).astype(np.float32)   # next token | last


def chain_logits(last: int, drafts) -> mx.array:
    """The target's logits at the k + 1 positions of a chunk [last, d1..dk] of a Markov chain."""
    return mx.array(CHAIN[[last, *drafts]])


def decode(params, n: int, drafter, left: int = 100, eos=frozenset(), seed: int = 11) -> tuple[list[int], int]:
    """n tokens (or to the row's end) after token 0, drafts from drafter(tokens so far); -> (tokens, passes)."""
    out, passes = [], 0
    while len(out) < n:
        drafts = drafter([0, *out])
        v = verify(chain_logits(([0, *out])[-1], drafts),
                   [Draft(drafts, params, seed=seed, position=len(out), left=left - len(out), eos_ids=eos)])[0]
        out, passes = out + v.tokens, passes + 1
        if v.finish:
            break
    return out, passes


def none(history):
    return []


def greedy_path(history, k=4):
    """Drafts the target's own argmax: all accepted."""
    d = []
    for _ in range(k):
        d.append(int(np.argmax(CHAIN[(history + d)[-1]])))
    return d


def noise(history, k=3):
    return list(np.random.default_rng(len(history)).integers(0, V, k))


@pytest.mark.parametrize("params", [GREEDY, HOT], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafter", [greedy_path, noise], ids=["right", "wrong"])
def test_drafts_without_probabilities_never_change_a_rows_text(params, drafter):
    """Greedy rows keep the argmax; a seeded sampled row with lookup drafts gives the text it gives without."""
    alone, passes_alone = decode(params, 24, none)
    drafted, passes = decode(params, 24, drafter)
    assert drafted[:24] == alone
    assert passes_alone == 24
    if drafter is greedy_path and params is GREEDY:
        assert passes == 5   # 4 drafts accepted and one token of its own a pass


def test_greedy_keeps_the_drafts_until_the_first_mismatch_then_the_targets_token():
    logits = mx.array(np.eye(V, dtype=np.float32)[[3, 5, 2, 6, 1]] * 10)   # the argmax at each position
    rows = [Draft([3, 5, 7, 6], GREEDY, 0, 0, 100)]
    v = verify(logits, rows)[0]
    assert (v.tokens, v.accepted, v.finish) == ([3, 5, 2], 2, None)
    assert verify(logits[:1], [Draft([], GREEDY, 0, 0, 100)])[0].tokens == [3]


def test_eos_and_max_tokens_end_a_row_inside_its_accepted_run():
    logits = mx.array(np.eye(V, dtype=np.float32)[[3, 5, 2, 6, 1]] * 10)
    stop = verify(logits, [Draft([3, 5, 2, 6], GREEDY, 0, 0, 100, eos_ids=frozenset({5}))])[0]
    assert (stop.tokens, stop.finish) == ([3], "stop")
    length = verify(logits, [Draft([3, 5, 2, 6], GREEDY, 0, 0, left=2)])[0]
    assert (length.tokens, length.finish) == ([3, 5], "length")
    assert decode(HOT, 50, noise, left=7)[0] == decode(HOT, 50, none, left=7)[0]


def test_rows_of_a_batch_are_decided_each_on_its_own():
    """A batch of greedy, sampled and draft-model rows gives each row what it gives alone."""
    q = np.full((2, V), 1.0 / V)
    rows = [Draft([1, 2], GREEDY, 0, 0, 100), Draft([4], HOT, 7, 3, 100), Draft([], HOT, 8, 0, 100),
            Draft([6, 0], SamplingParams(temperature=0.8), 9, 5, 100, probs=q)]
    logits = [chain_logits(2, r.tokens.tolist()) for r in rows]
    together = verify(mx.concatenate(logits), rows)
    assert together == [verify(x, [r])[0] for x, r in zip(logits, rows)]


def test_a_draft_model_row_accepts_what_the_target_agrees_with_and_never_what_it_cannot_give():
    p = np.full(V, 1.0 / V, dtype=np.float32)
    same = Draft([2, 3, 4], HOT, 1, 0, 100, probs=np.tile(p, (3, 1)))   # q = p: every draft accepted
    assert verify(mx.array(np.log(np.tile(p, (4, 1)))), [same])[0].accepted == 3
    p0 = np.log(np.where(np.arange(V) == 2, 1e-30, 1.0)).astype(np.float32)   # the target never gives 2
    for seed in range(20):
        q = np.eye(V, dtype=np.float32)[[2]]
        row = Draft([2], SamplingParams(temperature=1.0), seed, 0, 100, probs=q)
        v = verify(mx.array(np.stack([p0, p0])), [row])[0]
        assert v.accepted == 0 and v.tokens[0] != 2


def test_a_rerun_gives_the_same_text_and_another_seed_another():
    assert decode(HOT, 30, noise) == decode(HOT, 30, noise)
    assert decode(HOT, 30, none)[0] != decode(HOT, 30, none, seed=12)[0]


def test_uniforms_are_a_pure_function_of_seed_index_and_stream():
    u = uniforms([1, 1, 2, -1], [0, 1, 0, 0], 0)
    assert np.array_equal(u, uniforms([1, 1, 2, -1], [0, 1, 0, 0], 0))
    assert len(set(u.tolist())) == 4 and ((u > 0) & (u < 1)).all()
    assert not np.array_equal(u, uniforms([1, 1, 2, -1], [0, 1, 0, 0], 1))
    assert abs(uniforms(np.arange(20000), np.zeros(20000, int), 0).mean() - 0.5) < 0.01


def test_logits_of_the_wrong_shape_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match=r"expected \[3, V\]"):
        verify(mx.zeros((2, V)), [Draft([1, 2], GREEDY, 0, 0, 10)])
    with pytest.raises(ValueError, match=r"draft probabilities \(1, 8\): expected \[2, V\]"):
        Draft([1, 2], HOT, 0, 0, 10, probs=np.zeros((1, V)))
