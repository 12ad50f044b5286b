"""The stage model's round time and bubble."""

import pytest

from spill.admission.passmodel import PassModel, PassShape
from spill.stages.model import (best_micro_batches, hop_price, idle_shares, job_seconds, pass_seconds, replica_seconds,
                                round_seconds)


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


def test_a_micro_batchs_hop_paces_the_round_where_the_link_is_slower_than_its_turn_and_adds_to_the_fill():
    model = PassModel(bandwidth=1e9, per_row_s=0.01, overhead_s=0.1)   # c = 0.64 s for 64 decode rows
    step = PassShape(64, 0, 0, 0)
    # rank 1's link in: 1 ms and 1 MB/s; a token's hidden states 1000 bytes: a micro-batch of 32 rows crosses in 33 ms
    hop = hop_price([[8e9, 0.5, 0.001, 1e6]], 1000)
    assert hop(32) == pytest.approx(0.033)
    turn = 0.64 / 4
    assert pass_seconds(model, step, 2, 2, hop=hop) == pytest.approx(3 * turn + 0.033 + 0.1)   # hidden by the turn
    slow = hop_price([[8e9, 0.5, 0.001, 1e5]], 1000)   # 0.321 s a micro-batch: the link paces the round
    assert pass_seconds(model, step, 2, 2, rounds=4, hop=slow) == pytest.approx(8 * 0.321 + turn + 0.321 + 0.1)
    # the slowest of the links sets the pace; a host told no link (an older group's) prices none
    assert hop_price([[8e9, 0.5, 0.001, 1e6], [8e9, 0.5, 0.001, 1e5]], 1000)(32) == pytest.approx(0.321)
    assert hop_price([[8e9, 0.5]], 1000)(32) == 0.0
    assert pass_seconds(model, step, 2, 2, hop=hop_price([[8e9, 0.5]], 1000)) == pass_seconds(model, step, 2, 2)
