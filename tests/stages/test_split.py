"""The layer ranges of a pipeline's stages, split by bytes (streamed) or by compute (resident)."""

import math
from pathlib import Path

import pytest

from spill.errors import SpillError
from spill.factory.families import get_family, tensor_shapes
from spill.factory.presets import Shape
from spill.stages.split import (compute_costs, host_capacity, resident_names, split, stage_plans, stage_ranges,
                                 stage_shares)
from spill.streamer.plan import ModelPlan, TensorSpec, layer_of, load_plan


def _plan(shape: Shape, tied: bool) -> ModelPlan:
    """A llama of `shape` in float32 as its headers would give it; no file behind it."""
    layers, resident = [[] for _ in range(shape.layers)], []
    for name, dims in tensor_shapes(get_family("llama"), shape, tied=tied):
        t = TensorSpec(name, Path("model.safetensors"), 0, 4 * math.prod(dims), "F32", dims)
        (resident if layer_of(name) is None else layers[layer_of(name)]).append(t)
    return ModelPlan(Path("."), {"hidden_size": shape.hidden, "tie_word_embeddings": tied}, layers, resident)


# hidden 128 and a 32k vocabulary: the head (4.2M weights) costs as much as 21 layers (197k each)
HEAVY_HEAD = Shape(hidden=128, layers=12, intermediate=384, heads=4, kv_heads=2, head_dim=32, vocab=32768)


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


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_resident_split_prices_the_head_on_the_last_stage_and_the_embedding_as_nothing(tied):
    plan = _plan(HEAVY_HEAD, tied)
    layers, head = compute_costs(plan)
    assert layers == [128 * 128 * 2 + 2 * 128 * 64 + 3 * 128 * 384] * 12 and head == 32768 * 128
    streamed, resident = (stage_shares(plan, 2, by_compute=c) for c in (False, True))
    # by bytes the embedding on the first balances the head on the last; by compute the head is the last's alone
    assert [s.layers for s in streamed] == [range(0, 6), range(6, 12)]
    assert [s.layers for s in resident] == [range(0, 11), range(11, 12)]
    assert [p.total_bytes for p in stage_plans(plan, 2, by_compute=True)] == [s.bytes for s in resident]


def test_a_tiny_models_head_moves_a_layer_to_the_first_stage_where_the_group_runs_resident(make_tiny):
    plan = load_plan(make_tiny("llama", "float32"))   # 4 layers, the head a third more than a layer
    assert [s.layers for s in stage_shares(plan, 2)] == [range(0, 2), range(2, 4)]
    assert [s.layers for s in stage_shares(plan, 2, by_compute=True)] == [range(0, 3), range(3, 4)]


def test_a_quantized_models_packed_weights_cost_what_its_float_ones_do(make_tiny):
    floats, packed = (load_plan(make_tiny("llama", "float32", bits=b)) for b in (None, 4))
    assert compute_costs(packed) == compute_costs(floats)


@pytest.mark.parametrize("by_compute", [False, True], ids=["bytes", "compute"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 12])
def test_every_split_is_contiguous_covers_every_layer_and_gives_each_stage_one(by_compute, n):
    shares = stage_shares(_plan(HEAVY_HEAD, False), n, by_compute=by_compute)
    assert len(shares) == n and all(len(s.layers) >= 1 for s in shares)
    assert [i for s in shares for i in s.layers] == list(range(12))


def test_each_hosts_budget_weighs_its_share_and_equal_budgets_split_as_none_given():
    assert host_capacity(100, [(200, 0.5)], 2) is None                    # rank 1's budget is rank 0's
    assert host_capacity(100, [(1000, 0.5)], 3) == [100, 500, 100]        # rank 2 told none: taken as rank 0's
    assert host_capacity(100, [(0, 0.5)], 2) == [100, 1]                  # never a zero capacity
    plan = _plan(HEAVY_HEAD, tied=False)
    assert stage_ranges(plan, 2, capacity=[7, 7]) == stage_ranges(plan, 2)
    small, large = stage_ranges(plan, 2, capacity=[4, 1]), stage_ranges(plan, 2, capacity=[1, 4])
    assert len(small[1]) < len(stage_ranges(plan, 2)[1]) < len(large[1])
