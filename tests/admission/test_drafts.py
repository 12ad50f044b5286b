"""The draft count policy with hand-made pass models: drafts where the read hides them, none where a pass
is compute-bound, K where asked."""

import numpy as np
import pytest

from spill.admission import drafts
from spill.admission.passmodel import PassModel, PassShape

GB = 1_000_000_000
# Apple's GPU streaming a 70B model: 26 s of reading a pass, ~3 s of math at 150 rows
GPU = PassModel(bandwidth=5.4e9, fixed_s=0.5, per_row_s=0.015, per_context_token_s=1e-6, overlap=0.9,
                read_tail_s=0.3)
# two CPU cores: the math is longer than the read
CPU = PassModel(bandwidth=2e9, fixed_s=0.2, per_row_s=0.08, per_context_token_s=1e-5, overlap=0.6)


def shape(rows: int, context: int, gb: float = 140.0, prefill: int = 0) -> PassShape:
    return PassShape(rows, prefill, rows * context, int(gb * GB))


def test_an_io_bound_pass_gives_rows_drafts_up_to_what_its_read_hides():
    rows = 150
    k = drafts.counts("auto", GPU, shape(rows, 900), np.full(rows, 900), np.full(rows, 0.8), np.full(rows, 500))
    assert (k == drafts.AUTO_MOST).all()
    assert GPU.compute_s(drafts.padded(shape(rows, 900), 1 + k.max())) <= GPU.io_s(shape(rows, 900))


def test_where_the_read_hides_few_drafts_the_cap_is_what_pays_and_rows_that_accept_less_carry_fewer():
    model = PassModel(bandwidth=5.4e9, fixed_s=0.5, per_row_s=0.02, per_context_token_s=1e-6, read_tail_s=0.3)
    s, ctx = shape(200, 500, gb=140.0), np.full(200, 500)
    rates = np.where(np.arange(200) % 2 == 0, 0.9, 0.4)
    k = drafts.counts("auto", model, s, ctx, rates, np.full(200, 500))
    c = int(k.max())
    assert 0 < c < drafts.AUTO_MOST and (k[rates == 0.9] == c).all() and (k[rates == 0.4] == min(c, 3)).all()
    tokens_per_s = lambda cap: (drafts.tokens_per_row(rates, np.minimum(cap, drafts.worth(rates, 8))).sum()  # noqa: E731
                                / model.pass_s(drafts.padded(s, 1 + cap)))
    assert all(tokens_per_s(c) >= tokens_per_s(other) for other in range(1, drafts.AUTO_MOST + 1))


def test_a_compute_bound_pass_drafts_nothing():
    rows = 64
    s = shape(rows, 300, gb=2.0)     # 1 s of reading against 0.2 + 64 x 0.08 = 5.3 s of math
    assert CPU.compute_s(s) > CPU.io_s(s)
    assert not drafts.counts("auto", CPU, s, np.full(rows, 300), np.full(rows, 0.9), np.full(rows, 100)).any()


def test_nothing_to_hide_under_or_nothing_to_price_with_drafts_nothing():
    ctx, rates, left = np.full(4, 100), np.full(4, 0.9), np.full(4, 100)
    assert not drafts.counts("auto", GPU, shape(4, 100, gb=0), ctx, rates, left).any()   # resident
    assert not drafts.counts("auto", None, shape(4, 100), ctx, rates, left).any()
    assert drafts.counts("auto", GPU, shape(0, 0), [], [], []).size == 0


def test_a_draft_that_would_lower_the_passs_tokens_per_second_is_not_taken():
    """Read and compute in series: every draft's math lengthens the pass; 10 rows, 1 s read, 0.5 s math.
    A draft pays while its value beats 0.05 s x the pass's tokens per second (~7): a^1 = 0.5 does, a^2 not."""
    serial = PassModel(bandwidth=1e9, per_row_s=0.05, overlap=0.0)
    k = drafts.counts("auto", serial, PassShape(10, 0, 0, GB), np.zeros(10), np.full(10, 0.5), np.full(10, 100))
    assert k.tolist() == [1] * 10


def test_rows_that_rarely_accept_draft_nothing_even_where_drafts_are_free():
    k = drafts.counts("auto", GPU, shape(3, 100), np.full(3, 100), np.array([0.01, 0.2, 0.6]), np.full(3, 100))
    assert k.tolist() == [0, 1, 5]   # 0.2^2 and 0.6^6 are below LEAST (0.05)


@pytest.mark.parametrize("mode, expected", [(0, [0, 0, 0, 0]), (4, [4, 4, 2, 0])])
def test_off_and_k_ignore_the_pass_model_but_never_draft_past_a_rows_last_token(mode, expected):
    k = drafts.counts(mode, CPU, shape(4, 100, gb=1.0), np.full(4, 100), np.full(4, 0.1), np.array([100, 5, 3, 1]))
    assert k.tolist() == expected


def test_acceptance_follows_what_a_rows_drafts_do():
    hits, tried = np.zeros(3), np.zeros(3)
    assert drafts.rate(hits, tried).tolist() == [drafts.PRIOR] * 3
    for _ in range(10):   # row 0 accepts all 4, row 1 none, row 2 drafts nothing
        hits, tried = drafts.observe(hits, tried, [4, 4, 0], [4, 0, 0])
    a = drafts.rate(hits, tried)
    assert a[0] > 0.9 and a[1] < 0.2 and a[2] == drafts.PRIOR   # the prior keeps a failing row probing
    # a rejection after 2 acceptances: 2 of 3 tried, whatever was drafted after it
    one = drafts.observe(np.zeros(1), np.zeros(1), [6], [2])
    assert (one[0][0], one[1][0]) == (2, 3)


def test_tokens_per_row_is_the_geometric_sum():
    assert drafts.tokens_per_row(0.6, 4) == pytest.approx(2.3056)
    assert drafts.tokens_per_row(0.8, 4) == pytest.approx(3.3616)
    assert drafts.tokens_per_row(0.5, 0) == 1.0 and drafts.tokens_per_row(1.0, 3) == 4.0


def test_auto_drafts_nothing_where_a_drafting_pass_costs_more_than_its_tokens_give():
    from spill.admission.passmodel import PassModel, PassShape
    read_bound = PassModel(bandwidth=2.8e9, fixed_s=0.01, per_row_s=2e-4, overlap=0.95, read_tail_s=0.0)
    shape, rates, left = PassShape(16, 0, 4000, 266_000_000), [0.3] * 16, [100] * 16
    assert drafts.counts("auto", read_bound, shape, [250] * 16, rates, left).sum() > 0   # drafts ride the read
    costly = PassModel(**{**vars(read_bound), "draft_s": 0.064})   # as measured: 2/3 of the read
    assert drafts.counts("auto", costly, shape, [250] * 16, rates, left).sum() == 0
    assert drafts.counts("auto", costly, shape, [250] * 16, [0.95] * 16, left).sum() > 0   # rows that take all


def test_auto_drafts_nothing_where_a_draft_models_steps_cost_more_than_its_tokens_give():
    from spill.admission.drafter import DraftCost
    rows = 16
    args = (GPU, shape(rows, 900), np.full(rows, 900), np.full(rows, 0.8), np.full(rows, 500))
    assert (drafts.counts("auto", *args, DraftCost(step_s=0.01)) == drafts.AUTO_MOST).all()   # steps under the read
    # a pass of ~26 s: steps of 6 s pay at acceptance 0.8 (4 drafts: 3.4 tokens a row in 2x the time), of 30 s not
    assert drafts.counts("auto", *args, DraftCost(step_s=6.0)).sum() > 0
    assert drafts.counts("auto", *args, DraftCost(step_s=30.0)).sum() == 0
    assert drafts.counts(4, *args, DraftCost(step_s=30.0)).max() == 4         # --speculate K drafts anyway
