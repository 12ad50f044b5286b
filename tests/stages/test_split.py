"""The layer ranges of a pipeline's stages, split by bytes."""

import pytest

from spill.errors import SpillError
from spill.stages.split import resident_names, split, stage_plans, stage_shares
from spill.streamer.plan import load_plan


def test_equal_layers_split_evenly_with_the_embedding_and_head_counted():
    assert split([10] * 6, 2) == [range(0, 3), range(3, 6)]
    assert split([10] * 6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    # a head as big as two layers on the last stage moves two layers to the first
    assert split([10] * 6, 2, last=20) == [range(0, 4), range(4, 6)]


def test_the_largest_stage_is_as_small_as_any_contiguous_split_allows():
    costs = [5, 1, 1, 1, 9, 2, 2, 3]
    ranges = split(costs, 3)
    assert [i for r in ranges for i in r] == list(range(8))
    worst = max(sum(costs[i] for i in r) for r in ranges)
    brute = min(max(sum(costs[:a]), sum(costs[a:b]), sum(costs[b:]))
                for a in range(1, 7) for b in range(a + 1, 8))
    assert worst == brute == 9


def test_a_rank_with_twice_the_memory_takes_twice_the_layers():
    assert split([10] * 9, 2, capacity=[2, 1]) == [range(0, 6), range(6, 9)]
    assert split([10] * 9, 2, capacity=[1, 2]) == [range(0, 3), range(3, 9)]


def test_more_stages_than_layers_is_refused_with_the_fix():
    with pytest.raises(SpillError, match="5 stages for a model of 4 layers.*run at most 4 ranks"):
        split([1] * 4, 5)
    with pytest.raises(SpillError, match="expected 2 positive capacities"):
        split([1] * 4, 2, capacity=[1, 0])
    assert split([1] * 4, 4) == [range(i, i + 1) for i in range(4)]


def test_a_model_folder_splits_by_its_layer_bytes(make_tiny):
    plan = load_plan(make_tiny("llama", "float32"))
    shares = stage_shares(plan, 2)
    assert [i for s in shares for i in s.layers] == list(range(len(plan.layers)))
    assert sum(s.layer_bytes for s in shares) == plan.streamed_bytes
    first, last = resident_names(plan, True, False), resident_names(plan, False, True)
    assert first == {"model.embed_tokens.weight"}
    assert "model.norm.weight" in last and "model.embed_tokens.weight" not in resident_names(plan, False, False)
    assert stage_shares(plan, 1)[0].bytes == plan.total_bytes


def test_each_stage_plan_holds_its_shares_layers_and_tensors_and_nothing_else(make_tiny):
    plan = load_plan(make_tiny("llama", "float32"))
    plans, shares = stage_plans(plan, 3), stage_shares(plan, 3)
    assert [p.streamed_bytes for p in plans] == [s.layer_bytes for s in shares]
    assert [p.total_bytes for p in plans] == [s.bytes for s in shares]
    assert [t.name for p in plans for ts in p.layers for t in ts] == [t.name for ts in plan.layers for t in ts]
    assert stage_plans(plan, 1) == [plan]
