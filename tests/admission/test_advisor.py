"""The advisor on a tiny model's real prices, with the working set (--memory) chosen around them."""

import pytest

from spill.admission.advisor import _faster, _slots, advise, quantized
from spill.admission.passmodel import PassModel
from spill.admission.prices import fmt
from spill.admission.schedule import budget_policy
from spill.admission.simulate import SimRow
from spill.memory import default_fraction
from spill.stages.split import stage_plans
from spill.streamer.plan import load_plan

ROWS = [SimRow(i, 20, 44) for i in range(4)]          # 64 tokens each: width class 64


def memory_for(plan, slots: float, resident=True, **stages) -> str:
    """A working set (bytes, as --memory takes it) whose budget leaves KV for `slots` rows of 64 tokens (of each
    stage's share, with `stages`: stages=N and by_compute)."""
    s = budget_policy(plan, "1GB", resident=resident, **stages)[0].sheet
    return str(int((sum(s.fixed.values()) + slots * s.cost(1, 64)) / s.fraction) + 1)


@pytest.fixture
def plan(make_tiny, monkeypatch):
    monkeypatch.setenv("SPILL_PREFILL_TOKENS", "512")   # one chunk: the budget prices no fewer on a small machine
    return load_plan(make_tiny("llama"))


def test_a_model_that_fits_with_the_jobs_kv_runs_resident_and_says_so(plan):
    memory = memory_for(plan, 4.5)
    a = advise(plan, ROWS, memory)
    s = budget_policy(plan, memory, resident=True)[0].sheet
    assert a.resident and a.slots == 4 and a.weights == plan.total_bytes * 2   # bf16 computed in float32 here
    assert a.line == (f"resident: the weights ({fmt(a.weights)}) and the job's KV ({fmt(s.cost(4, 64))} for 4 rows "
                      f"at once) fit the {fmt(s.budget)} memory budget; only the first pass reads the disk "
                      "(--stream streams every pass)")


def test_stream_forces_streaming_and_still_says_resident_would_fit(plan):
    a = advise(plan, ROWS, memory_for(plan, 4.5), stream=True)
    assert not a.resident
    assert a.line.startswith("streamed (--stream or SPILL_STREAM), though resident would fit: the weights (")


def test_a_smaller_resident_batch_runs_resident_only_where_the_pass_model_rates_it_faster(plan):
    memory = memory_for(plan, 2.5)             # resident: 2 of the 4 rows at once; streamed: all 4
    slow_disk = PassModel(bandwidth=1e6, fixed_s=0.01, per_row_s=0.001)
    fast_disk = PassModel(bandwidth=1e12, fixed_s=0.01, per_row_s=0.001)
    a = advise(plan, ROWS, memory, passes=slow_disk)
    assert a.resident and a.slots == 2
    assert "leave KV for 2 of the job's 4 rows at once in the " in a.line
    assert "faster by the pass model than streaming 4 at once" in a.line
    b = advise(plan, ROWS, memory, passes=fast_disk)
    assert not b.resident and b.line.startswith("streamed: resident, the weights (")
    assert not advise(plan, ROWS, memory).resident      # no pass model: only the whole batch counts


def test_a_model_too_big_resident_streams_and_names_the_quantized_variant_that_fits(plan):
    four, eight = quantized(plan, 4, 64), quantized(plan, 8, 64)
    memory = memory_for(four, 4.5)
    budget = budget_policy(eight, memory, resident=True)[0].sheet
    assert sum(budget.fixed.values()) + budget.cost(4, 64) > budget.budget   # 8-bit does not fit here
    variants = [("t:tiny-8bit", 8, 64), ("t:tiny-4bit", 4, 64)]
    a = advise(plan, ROWS, memory, variants=variants)
    s = budget_policy(plan, memory, resident=True)[0].sheet
    assert not a.resident
    assert a.line == (f"streamed: resident, the weights ({fmt(a.weights)}), the job's KV ({fmt(s.cost(4, 64))} for 4 "
                      f"rows at once) and the buffers and activations ({fmt(sum(s.fixed.values()) - a.weights)}) would "
                      f"need more than the {fmt(s.budget)} memory budget (78% of the {fmt(int(memory))} working set); "
                      "t:tiny-4bit would fit resident: spill run t:tiny-4bit")
    assert advise(plan, ROWS, memory_for(eight, 4.5), variants=variants).line.endswith("spill run t:tiny-8bit")
    assert "would fit" not in advise(plan, ROWS, memory_for(four, 3.5), variants=variants).line   # none fits


def test_the_quantized_plan_is_the_factorys_quantized_model_tensor_for_tensor(make_tiny):
    want = load_plan(make_tiny("llama", bits=4, group_size=64))
    got = quantized(load_plan(make_tiny("llama")), 4, 64)

    def tensors(p):
        return {t.name: (t.dtype, t.shape, t.nbytes) for ts in [*p.layers, p.resident] for t in ts}
    assert tensors(got) == tensors(want)


def test_the_groups_other_processes_count_against_the_resident_budget(plan):
    memory = memory_for(plan, 4.5)
    slot = budget_policy(plan, memory, resident=True)[0].sheet.cost(1, 64)
    assert advise(plan, ROWS, memory).resident
    assert not advise(plan, ROWS, memory, others=slot).resident   # one slot less: the batch no longer fits


def test_a_pipeline_prices_each_stage_on_its_share_and_runs_resident_where_the_tightest_fits(plan):
    memory = memory_for(plan, 0.5)   # resident: not one row of the whole model's KV beside its weights
    one, two = advise(plan, ROWS, memory), advise(plan, ROWS, memory, stages=2)
    assert not one.resident and two.resident and two.weights < one.weights / 1.5
    assert " of each of 2 ranks (the tightest stage's share; layers split by compute)" in two.line and two.by_compute
    alone, staged = (budget_policy(plan, memory, stages=n)[0].sheet for n in (1, 2))
    assert staged.kv_per_token * 2 == alone.kv_per_token   # each stage holds its layers' share of a row's KV
    assert staged.kv_budget > alone.kv_budget               # and only its share of the weights in flight


def test_a_resident_pipeline_splits_by_compute_where_its_stages_fit_so_else_by_bytes(plan):
    """The tiny model's head weighs a layer and a third: split by compute its first stage holds 3 layers of 4 and
    the embedding, more than either stage split by bytes."""
    by_bytes, by_compute = (memory_for(plan, 4.5, stages=2, by_compute=c) for c in (False, True))
    assert int(by_bytes) < int(by_compute)
    a, b = advise(plan, ROWS, by_bytes, stages=2), advise(plan, ROWS, by_compute, stages=2)
    assert a.resident and not a.by_compute and "(the tightest stage's share; layers split by bytes)" in a.line
    assert b.resident and b.by_compute and b.weights > a.weights
    streamed = advise(plan, ROWS, memory_for(plan, 0.5, stages=2), stages=2)
    assert not streamed.resident and not streamed.by_compute
    assert not advise(plan, ROWS, by_compute, stages=2, stream=True).by_compute   # --stream: split by bytes


def test_a_pipelines_smaller_resident_batch_is_rated_as_its_stages_run_it(plan):
    """Resident, a pipeline's stages split the compute and run several rounds a pass (stages/model.py): where one
    process streams its whole batch faster, two stages may still run fewer rows faster resident (the tiny model's
    streamed stage never holds more rows than a resident one, so the rating is asked directly)."""
    compute_bound = PassModel(bandwidth=1e12, fixed_s=0.001, per_row_s=0.01)
    assert not _faster(compute_bound, plan, 2, 4, ROWS)                       # one process: stream all 4
    assert _faster(compute_bound, plan, 2, 4, ROWS, (2, 2, 1, 1.0, None))     # 2 stages, 2 micro-batches
    assert not _faster(compute_bound, plan, 2, 4, ROWS, (2, 2, 1, 1.0, lambda tokens: 5.0))   # over a slow link
    assert not _faster(compute_bound, plan, 2, 4, ROWS, (2, 2, 1, 2.0, None))  # whose passes took twice the price
    fixed_bound = PassModel(bandwidth=1e12, fixed_s=0.05, per_row_s=0.001)   # each micro-batch pays it again
    assert not _faster(fixed_bound, plan, 2, 4, ROWS, (2, 2, 1, 1.0, None))
    assert _faster(fixed_bound, plan, 2, 4, ROWS, (3, 1, 8, 1.0, None))     # 3 stages, 1 micro-batch, 8 rounds


def test_a_pipeline_stage_prices_its_share_against_its_own_hosts_budget(plan):
    """Rank 1's host with less memory than rank 0's: the group runs resident only where its share fits there."""
    memory = memory_for(plan, 4.5, stages=2, by_compute=True)
    assert advise(plan, ROWS, memory, stages=2).resident   # every host taken as rank 0's: it fits
    last = stage_plans(plan, 2, by_compute=True)[1]
    small = [(int(memory_for(last, 0.5)), 0.78)]   # rank 1's host: half a row's KV beside its share resident
    a = advise(plan, ROWS, memory, stages=2, hosts=small)
    assert not a.resident and "of rank 1, the tightest of 2 ranks' shares" in a.line, a.line
    big = [(10 * int(memory), 0.78)]   # rank 1 with more: rank 0's stage is the tightest, as before
    b, alike = advise(plan, ROWS, memory, stages=2, hosts=big), advise(plan, ROWS, memory, stages=2)
    assert (b.resident, b.slots, b.budget, b.by_compute) == (alike.resident, alike.slots, alike.budget, alike.by_compute)
    assert "budget of rank 0, the tightest of 2 ranks' shares, each against its own host's budget" in b.line
    same = advise(plan, ROWS, memory, stages=2, hosts=[(int(memory), default_fraction())])   # one machine's
    assert same == alike   # every host as rank 0's: one host's advice, word for word
    tight, _ = budget_policy(plan, memory, stages=2, hosts=small)
    assert tight.sheet.working_set == small[0][0]   # admission's policy: rank 1's, on its own working set


def test_a_host_with_a_smaller_budget_holds_fewer_layers_so_its_share_fits(tmp_path):
    """Rank 1's host with room for little more than half the weights: the split weighs each host's budget, so it
    holds fewer layers and the pipeline runs resident where an even split left rank 1 no room for a row."""
    from spill.factory import make_model
    from spill.stages.split import host_capacity, stage_ranges
    plan = load_plan(make_model(tmp_path / "m", family="llama", size="small", dtype="float32"))   # 8 layers
    even = stage_plans(plan, 2)[1]
    weights = sum(t.nbytes for t in even.resident) + sum(even.layer_bytes(i) for i in range(len(even.layers)))
    small = [(int(1.2 * weights / default_fraction()), default_fraction())]
    assert _slots(budget_policy(even, small[0][0], resident=True)[0], 4, 64) == 0   # not a row beside half the layers
    rank0 = 20 * small[0][0]
    policy, ws = budget_policy(plan, str(rank0), resident=True, stages=2, hosts=small)
    assert _slots(policy, 4, 64) == 4 and ws.source == "rank 1"   # still the tightest, and now it holds the rows
    capacity = host_capacity(int(rank0 * default_fraction()), small, 2)
    assert stage_ranges(plan, 2, capacity=capacity) == [range(0, 7), range(7, 8)]


def test_ranks_that_each_hold_the_whole_model_and_a_share_of_the_batch_run_as_replicas_and_say_why(plan):
    """Replicas where the whole model and half the job's rows fit each of 2 ranks; a pipeline where only a stage's
    share of the layers does, with SPILL_REPLICAS=0 (`replicas` False) or --stream."""
    memory = memory_for(plan, 2.5)   # the whole model resident and 2 of the 4 rows' KV: half the batch
    assert not advise(plan, ROWS, memory).resident   # one process: the job's batch does not fit beside the weights
    a = advise(plan, ROWS, memory, stages=2)
    s = budget_policy(plan, memory, resident=True)[0].sheet
    assert a.replicas and a.resident and not a.by_compute and a.slots == 4 and a.weights == plan.total_bytes * 2
    assert a.line == (f"replicas: the whole model ({fmt(a.weights)}) and a 1/2 share of the job's KV "
                      f"({fmt(budget_policy(plan, memory, resident=True, stages=2, replicas=True)[0].sheet.cost(4, 64))},"
                      f" 2 of its 4 rows at once) fit the {fmt(s.budget)} memory budget of each of 2 ranks; each rank "
                      "runs every layer on its own share of the rows, with no pipeline to fill and drain and no hidden "
                      "states between hosts; only the first pass reads the disk (--stream streams a pipeline instead)")
    assert not advise(plan, ROWS, memory_for(plan, 1.5), stages=2).replicas   # a row short on each rank: a pipeline
    piped = advise(plan, ROWS, memory, stages=2, replicas=False)
    assert piped.resident and not piped.replicas and " of each of 2 ranks (the tightest stage's share" in piped.line
    assert not advise(plan, ROWS, memory, stages=2, stream=True).replicas
    rank1 = [(int(memory_for(plan, 1.5)), default_fraction())]   # rank 1's host holds one row beside the model
    assert not advise(plan, ROWS, memory, stages=2, hosts=rank1).replicas


def test_replicas_price_each_row_at_a_share_of_its_kv_on_every_host(plan):
    memory = memory_for(plan, 2.5)
    alone = budget_policy(plan, memory, resident=True)[0].sheet
    two = budget_policy(plan, memory, resident=True, stages=2, replicas=True)[0].sheet
    assert two.fixed == alone.fixed and two.budget == alone.budget   # each rank holds the whole model
    assert two.kv_per_token * 2 == alone.kv_per_token and two.row_overhead * 2 == alone.row_overhead
