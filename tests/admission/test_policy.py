"""The budget policy with hand-written rows and pass reports (no model)."""

import numpy as np

from spill import messages as m
from spill.admission.policy import BudgetPolicy, Sheet, Waiting, live_allocation, sheet_for
from spill.admission import policy as policy_mod
from spill.platform import read_slots
from spill.streamer.plan import load_plan

MB = 2**20


def rows(*lengths, max_tokens=10, start=0):
    return [Waiting(start + i, np.arange(n, dtype=np.int32), max_tokens, [0.0, 1.0, 0, None])
            for i, n in enumerate(lengths)]


def sheet(slots_mb=5, working_set=1000 * MB, **kw):
    """A 1000 MiB machine whose budget leaves `slots_mb` MiB for KV; 256 tokens of KV cost 1 MiB."""
    fixed = {"weights": int(0.78 * working_set) - int(slots_mb * MB)}
    return Sheet(working_set, kv_per_token=MB // 256, fixed=fixed, **kw)


def run_pass(p: BudgetPolicy, live: int, finished=(), preempted=()):
    """What the admission actor does with one pass report: free rows, observe, then decide."""
    p.finished(list(finished))
    p.preempted(list(preempted))
    p.observe(live)
    return p.to_preempt(), [w.row for w in p.admit()]


def test_the_pool_is_sized_from_the_budget_and_never_exceeds_it():
    p = BudgetPolicy(sheet(slots_mb=1.25))
    p.offer(rows(*[10] * 7))
    assert [w.row for w in p.admit()] == [0, 1, 2, 3, 4]     # 20 tokens: 5 slots of 64 tokens, 1/4 MiB each
    assert p.shapes() == [[5, 64]] and p.reserved() == 5 * MB // 4 <= p.sheet.kv_budget
    assert p.admit() == []
    p.finished([0])
    assert [w.row for w in p.admit()] == [5]                 # a freed slot takes the next row
    assert p.reserved() == 5 * MB // 4


def test_each_row_joins_the_pool_of_its_width_class_and_a_full_class_holds_only_its_own_rows():
    p = BudgetPolicy(sheet(slots_mb=6))
    p.offer(rows(600, 10))                                   # 610 tokens: width 640 (2.5 MiB a slot); 20: 64
    assert [(w.row, w.width) for w in p.admit()] == [(0, 640), (1, 64)] and p.shapes() == [[1, 640], [1, 64]]
    p.offer(rows(600, 10, start=2))
    assert [w.row for w in p.admit()] == [3]                 # 3.25 MiB free: the 64 pool grows (1 + 2 fit), 640 not
    assert p.shapes() == [[1, 640], [2, 64]]
    p.finished([0])
    assert [w.row for w in p.admit()] == [2] and p.reserved() <= p.sheet.kv_budget


def test_a_pool_that_took_the_budget_before_other_widths_came_shrinks_at_once_to_its_rows():
    p = BudgetPolicy(sheet(slots_mb=8))
    p.offer(rows(*[10] * 40))                                # the job's first rows: all short (width 64)
    p.prefill_tokens = 80                                    # the pass's prompt allowance: 8 of them
    assert len(p.admit()) == 8 and p.shapes() == [[32, 64]]
    p.offer(rows(*[600] * 20, max_tokens=100, start=40))     # then the long rows, far more to generate
    _, admitted = run_pass(p, live=0)
    assert 40 in admitted                                    # they start now, not when the 8 short rows end
    assert p.shapes()[0] == [8, 64] and p.reserved() <= p.sheet.kv_budget


def test_a_row_too_big_for_the_budget_gets_one_sentence_and_the_rest_run():
    p = BudgetPolicy(sheet(slots_mb=2))
    refused = p.offer(rows(5, 600, 5))                       # 610 tokens: 2.4 MiB alone
    assert [(w.row, why.split(":")[0]) for w, why in refused] == [(1, "the prompt is 600 tokens and max_tokens 10")]
    assert "KV budget is 2.0 MiB" in refused[0][1] and "raise --memory or --budget-fraction" in refused[0][1]
    assert [w.row for w in p.admit()] == [0, 2]


def test_a_row_that_fits_only_unrounded_runs_alone():
    p = BudgetPolicy(sheet(slots_mb=2.4))
    p.offer(rows(600, 5))                                    # 610 tokens fit 2.4 MiB, 640 would not
    assert [w.row for w in p.admit()] == [0] and p.shapes() == [[1, 610]]


def test_the_guard_line_holds_admission_with_hysteresis():
    p = BudgetPolicy(sheet(slots_mb=10))
    p.offer(rows(5))
    run_pass(p, live=0)
    p.offer(rows(*[5] * 5, start=1))
    assert run_pass(p, live=810 * MB) == ([], [])              # above 80%: hold
    assert run_pass(p, live=790 * MB) == ([], [])              # under 80% but above the 78% budget: still holding
    assert run_pass(p, live=775 * MB) == ([], [1, 2, 3, 4, 5])  # within the budget, where full pools live


def test_above_the_guard_with_nothing_running_one_row_still_runs():
    p = BudgetPolicy(sheet(slots_mb=10))
    p.offer(rows(5, 5))
    assert run_pass(p, live=990 * MB) == ([], [0])
    assert run_pass(p, live=990 * MB) == ([], [])
    assert run_pass(p, live=990 * MB, finished=[0]) == ([], [1])


def test_the_hard_line_preempts_the_newest_rows_shrinks_the_pool_and_they_later_finish():
    p = BudgetPolicy(sheet(slots_mb=100), max_rows=8)
    p.offer(rows(*[40] * 8))
    assert run_pass(p, live=500 * MB) == ([], list(range(8)))
    assert p.shapes() == [[8, 64]]
    preempt, admitted = run_pass(p, live=802 * MB)           # 2 MiB over the guard line: 8 slots
    assert (preempt, admitted) == ([], [])                    # (below the hard line: hold only)
    preempt, admitted = run_pass(p, live=902 * MB)           # 102 MiB over: all but the oldest
    assert (preempt, admitted) == ([7, 6, 5, 4, 3, 2, 1], []) and p.shapes() == [[1, 64]]
    assert run_pass(p, live=905 * MB) == ([], [])              # not yet dropped: no second preemption
    assert run_pass(p, live=700 * MB, preempted=[7, 6, 5, 4, 3, 2, 1]) == ([], [])   # the pool is full
    assert run_pass(p, live=600 * MB, finished=[0]) == ([], list(range(1, 8)))       # drained: sized again
    assert run_pass(p, live=600 * MB, finished=range(1, 8)) == ([], [])
    assert not p.running and not p.queue


def test_the_oldest_row_is_never_preempted_so_no_row_starves():
    p = BudgetPolicy(sheet(slots_mb=10))
    p.offer(rows(40, 40, 40))
    run_pass(p, live=0)
    for _ in range(5):                                       # memory stays above the hard line
        preempt, _ = run_pass(p, live=950 * MB)
        assert 0 not in preempt
        run_pass(p, live=950 * MB, preempted=preempt)
    run_pass(p, live=0, finished=[0])
    assert sorted(p.running) == [1, 2]                       # the preempted rows run next


def test_live_allocation_takes_the_largest_view_of_memory():
    p = m.Pass(0, 1, 1.0, 0.0, 1.0, 4, 0, 4, [], active_memory=300, peak_memory=400, bytes_streamed=0,
               cache_memory=50, reader_memory=100, rss=420, cgroup_usage=None)
    assert live_allocation(p, others=80) == 450 + 80
    p.cgroup_usage = 900                           # page cache charged to the cgroup counts too
    assert live_allocation(p, others=80) == 900


def test_the_sheet_prices_kv_from_the_config_and_the_compute_dtype(make_tiny):
    plan = load_plan(make_tiny("llama"))
    c = plan.config
    s = sheet_for(plan, 2**30, 4, prefill_tokens=64, others=5 * MB)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    assert s.kv_per_token == c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 4
    assert s.fixed["resident"] == sum(t.nbytes // 2 * 4 for t in plan.resident)   # bf16 stored, f32 computed
    assert s.fixed["reader"] == max(plan.layer_bytes(i) for i in range(len(plan.layers)))   # one buffer on a CPU
    assert s.kv_budget == int(0.78 * 2**30) - sum(s.fixed.values())


def test_resident_prices_every_layer_as_a_fixed_part_and_none_in_flight(make_tiny):
    plan = load_plan(make_tiny("llama"))
    streamed = sheet_for(plan, 2**30, 4, prefill_tokens=64)
    resident = sheet_for(plan, 2**30, 4, prefill_tokens=64, resident=True)
    assert resident.fixed["resident"] == plan.total_bytes // 2 * 4 and resident.fixed["layers"] == 0
    assert streamed.fixed["layers"] > 0 and resident.kv_per_token == streamed.kv_per_token
    assert resident.fixed["cache_kv"] == 0   # no layer freed, so none to keep in the cache
    assert resident.kv_budget == streamed.kv_budget + streamed.fixed["cache_kv"] - (
        plan.streamed_bytes * 2 - streamed.fixed["layers"])


def _layer(plan, itemsize):
    return max(sum(t.nbytes // 2 * itemsize if t.dtype == "BF16" else t.nbytes for t in ts) for ts in plan.layers)


def test_a_float32_stored_plan_prices_a_freed_layer_in_the_cache_unless_the_reader_reads_into_it(make_tiny,
                                                                                                  monkeypatch):
    # measured: the streamer holds 2 converted layers and a cache of about 1 more (docs/benchmarks.md); on the
    # CPU the reader reads into a released layer's memory (eea0258), so none waits in the cache
    plan = load_plan(make_tiny("llama", dtype="float32"))
    layer = max(plan.layer_bytes(i) for i in range(len(plan.layers)))
    largest = max(t.nbytes for ts in plan.layers for t in ts)
    s = sheet_for(plan, 2**30, 4, prefill_tokens=64)
    assert s.fixed["reader"] == read_slots() * layer and s.fixed["layers"] == 2 * layer   # the read-ahead buffers
    assert s.fixed["cache"] == largest                       # this machine's CPU: recycled
    monkeypatch.setattr(policy_mod, "recycles_layers", lambda: False)   # a GPU's reader: a new buffer a layer
    assert sheet_for(plan, 2**30, 4, prefill_tokens=64).fixed["cache"] == layer + largest


def test_the_cache_keeps_room_for_what_a_decode_layer_frees_beside_the_freed_layer(make_tiny):
    """lean45 at 23 rows with a cache of one freed layer: each layer's freed KV stores and attention copies
    pushed the layer out, and every layer's memory was faulted in anew (651k faults a pass, passes 6.2 s)."""
    for family in ("llama", "qwen2"):
        plan = load_plan(make_tiny(family, dtype="float32"))
        s = sheet_for(plan, 2**30, 4, prefill_tokens=64)
        layer = max(plan.layer_bytes(i) for i in range(len(plan.layers)))
        before = s.kv_budget + s.fixed["cache_kv"]
        assert s.fixed["cache_kv"] == min(2 * before // len(plan.layers), layer) == layer
        fixed = sum(s.fixed.values()) - s.fixed["cache_kv"]
        small = sheet_for(plan, int((fixed + layer) / 0.78), 4, prefill_tokens=64)   # KV of one layer's size
        assert 0 < small.fixed["cache_kv"] == 2 * (small.kv_budget + small.fixed["cache_kv"]) // len(plan.layers) < layer


def test_a_cast_prices_the_stored_copies_it_frees_into_the_cache(make_tiny):
    plan = load_plan(make_tiny("llama"))   # bf16 stored, computed in float32
    s = sheet_for(plan, 2**30, 4, prefill_tokens=64)
    stored = max(plan.layer_bytes(i) for i in range(len(plan.layers)))
    largest = max(t.nbytes for ts in plan.layers for t in ts) * 2
    assert s.fixed["layers"] == 2 * _layer(plan, 4) == 4 * stored
    assert s.fixed["cache"] == _layer(plan, 4) + stored + largest


def test_the_cache_and_the_layers_in_flight_are_not_counted_twice(make_tiny):
    # a freed layer's buffers are the next conversion's: 3 converted layers at most, not 2 + a cache of 2
    for dtype in ("float32", "bfloat16"):
        plan = load_plan(make_tiny("llama", dtype=dtype))
        s = sheet_for(plan, 2**30, 4, prefill_tokens=64)
        assert s.fixed["layers"] + s.fixed["cache"] < 4 * _layer(plan, 4)
        assert s.fixed["cache_kv"] <= _layer(plan, 4)   # what a layer frees beside it: at most another layer


def test_the_streamers_runtime_in_its_rss_is_not_counted_again_with_the_others():
    # others = the other processes + the streamer's runtime (its RSS at READY), which its RSS holds too
    p = m.Pass(0, 1, 1.0, 0.0, 1.0, 4, 0, 4, [], active_memory=300, peak_memory=400, bytes_streamed=0,
               cache_memory=50, reader_memory=100, rss=600, cgroup_usage=None)
    assert live_allocation(p, others=80, runtime=50) == 600 + 80 - 50
    assert live_allocation(p, others=80, runtime=200) == 450 + 80   # MLX and the reader, where more
