"""The stage model's round time and bubble."""

import pytest

from spill.admission.passmodel import PassModel, PassShape
from spill.stages.model import best_micro_batches, idle_shares, job_seconds, pass_seconds, replica_seconds, round_seconds


def test_equal_stages_with_enough_micro_batches_never_idle():
    assert round_seconds([1.0, 1.0], [0.0, 0.0], 2) == 2.0
    assert idle_shares([1.0, 1.0, 1.0], [0.0] * 3, 3) == [0.0, 0.0, 0.0]


def test_fewer_micro_batches_than_stages_idle_each_stage_the_rest_of_the_trip():
    # one micro-batch through 2 stages: each works half the round
    assert idle_shares([1.0, 1.0], [0.0, 0.0], 1) == [0.5, 0.5]
    assert idle_shares([1.0] * 4, [0.0] * 4, 2) == [0.5] * 4


def test_a_slow_link_idles_every_stage_by_its_share_of_the_trip():
    # M = N = 2, t = 1, l = 0.25: a round is 2.5, a stage busy 2 of it
    assert idle_shares([1.0, 1.0], [0.25, 0.25], 2) == pytest.approx([0.2, 0.2])
    # one more micro-batch hides it
    assert idle_shares([1.0, 1.0], [0.25, 0.25], 3) == pytest.approx([0.0, 0.0])


def test_the_slowest_stage_sets_the_round_and_the_others_wait_on_it():
    assert round_seconds([1.0, 2.0], [0.0, 0.0], 3) == 6.0
    assert idle_shares([1.0, 2.0], [0.0, 0.0], 3) == pytest.approx([0.5, 0.0])


def test_a_job_adds_the_fill_once():
    assert job_seconds([1.0, 1.0, 1.0], [0.1, 0.1, 0.1], 3, rounds=10) == pytest.approx(10 * 3.3 + 2.2)


def test_micro_batches_are_the_fewest_that_hide_the_trip():
    # weights through memory cost 1 a micro-batch, rows 0.1 each: more micro-batches only add reads
    assert best_micro_batches([1.0, 1.0], [0.1, 0.1], [0.0, 0.0], rows=64) == 2
    # a slow link: a third micro-batch keeps the stages busy through the trip
    assert best_micro_batches([1.0, 1.0], [0.1, 0.1], [1.0, 1.0], rows=64) == 3
    assert best_micro_batches([1.0] * 3, [0.1] * 3, [0.0] * 3, rows=2) == 2   # never more than the rows


def test_a_resident_pipelines_pass_is_its_stages_shares_with_the_fill_and_drain_once_a_pass():
    model = PassModel(bandwidth=1e9, per_row_s=0.01, overhead_s=0.1)   # c = 0.64 s for 64 decode rows
    step = PassShape(64, 0, 0, 0)
    assert pass_seconds(model, step, 1, 1) == pytest.approx(model.pass_s(step))
    assert pass_seconds(model, step, 3, 3) == pytest.approx(5 / 9 * 0.64 + 0.1)   # 5 turns of a ninth
    assert pass_seconds(model, step, 3, 3, rounds=8) == pytest.approx(26 / 9 * 0.64 + 0.1)
    prompts = PassShape(0, 300, 0, 3_000_000_000, prefill_groups=3)    # the first pass: each stage reads a third
    assert pass_seconds(model, prompts, 3, 3) == pytest.approx(1.0 + 0.1)
    fixed = PassModel(bandwidth=1e9, fixed_s=0.3, per_row_s=0.01)      # each micro-batch takes a share of it again
    assert pass_seconds(fixed, step, 3, 3) == pytest.approx(5 * (0.1 + 0.64 / 9))


def test_a_replicas_pass_is_one_process_pass_of_the_largest_share_of_its_rows():
    model = PassModel(bandwidth=1e9, fixed_s=0.3, per_row_s=0.01, overhead_s=0.1)
    step = PassShape(64, 0, 6400, 0)
    assert replica_seconds(model, step, 1) == pytest.approx(model.pass_s(step))
    assert replica_seconds(model, step, 3) == pytest.approx(model.pass_s(PassShape(22, 0, 2134, 0)))   # 64/3 rounded up
    assert replica_seconds(model, step, 3) < pass_seconds(model, step, 3, 3)   # no micro-batch pays the fixed cost again
