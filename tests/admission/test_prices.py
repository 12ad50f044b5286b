"""The price sheet from a model's plan, and what a pass report says is live (no streamer)."""

from spill import messages as m
from spill.admission import prices as prices_mod
from spill.admission.prices import live_allocation, sheet_for
from spill.platform import read_slots
from spill.streamer.plan import load_plan

MB = 2**20


def test_live_allocation_takes_the_largest_view_of_memory():
    p = m.Pass(0, 1, 1.0, 0.0, 1.0, 4, 0, 4, [], active_memory=300, peak_memory=400, bytes_streamed=0,
               cache_memory=50, reader_memory=100, rss=420, cgroup_usage=None)
    assert live_allocation(p, others=80) == 450 + 80
    p.cgroup_usage = 900                           # page cache charged to the cgroup counts too
    assert live_allocation(p, others=80) == 900


def test_a_cgroups_usage_counts_only_where_its_limit_binds(make_tiny, monkeypatch):
    """--memory 600 MiB in a cgroup with no limit of its own (a container's, a desktop session's): its usage was
    every process's in it, 675 MiB, above the guard line, so admission held and the job ran a row at a time."""
    from spill.admission import schedule
    p = m.Pass(0, 1, 1.0, 0.0, 1.0, 4, 0, 4, [], active_memory=300 * MB, peak_memory=400 * MB, bytes_streamed=0,
               cache_memory=0, reader_memory=0, rss=320 * MB, cgroup_usage=675 * MB)
    plan = load_plan(make_tiny("llama"))
    for limit, binds in ((None, False), (2**30, False), (600 * MB, True), (500 * MB, True)):
        monkeypatch.setattr(schedule.memory, "cgroup_limit", lambda root="/", limit=limit: limit)
        sheet = schedule.budget_policy(plan, "600MiB")[0].sheet
        assert sheet.cgroup_binds is binds
        assert live_allocation(p, others=80 * MB, sheet=sheet) == (675 * MB if binds else 400 * MB)   # else its RSS and the others


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
    # CPU the reader reads into a released layer's memory (platform.recycles_layers), so none waits in the cache
    plan = load_plan(make_tiny("llama", dtype="float32"))
    layer = max(plan.layer_bytes(i) for i in range(len(plan.layers)))
    largest = max(t.nbytes for ts in plan.layers for t in ts)
    s = sheet_for(plan, 2**30, 4, prefill_tokens=64)
    assert s.fixed["reader"] == read_slots() * layer and s.fixed["layers"] == 2 * layer   # the read-ahead buffers
    assert s.fixed["cache"] == largest                       # this machine's CPU: recycled
    monkeypatch.setattr(prices_mod, "recycles_layers", lambda: False)   # a GPU's reader: a new buffer a layer
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


def test_on_a_cuda_gpu_the_hosts_buffers_and_processes_are_priced_against_the_hosts_memory(make_tiny):
    """MLX's arrays live in the GPU's memory there, the reader's pinned buffers and the other processes in the
    host's: one budget priced both against the least of the two (3 GiB caps on the H200: 31 rows of llama 3b)."""
    plan = load_plan(make_tiny("llama"))
    one = sheet_for(plan, 2**30, 2, prefill_tokens=64, others=100 * MB)
    two = sheet_for(plan, 2**30, 2, prefill_tokens=64, others=100 * MB, host_set=2**30)
    assert set(two.host) == {"reader", "others"} and two.host["others"] == 100 * MB
    assert not set(two.host) & set(two.fixed)
    once = one.fixed["prefill_kv"] - two.fixed["prefill_kv"]   # the prompts' KV priced once there (below)
    assert two.kv_budget > one.kv_budget >= two.kv_budget - sum(two.host.values()) - once   # cache_kv grows with it
    from spill.admission.prices import shortfall
    assert shortfall(two) is None
    crowded = sheet_for(plan, 2**30, 2, prefill_tokens=64, others=900 * MB, host_set=2**30)
    assert "the host's budget is" in shortfall(crowded) and "cgroup" in shortfall(crowded)


def test_on_a_cuda_gpu_the_prompts_kv_is_priced_once(make_tiny):
    """The H200's prefill passes held 425 MiB above decode for 2,048 prompt tokens of llama 3b, where the sheet
    priced 688 MiB (their KV twice); the CPU's price stays as it was."""
    plan = load_plan(make_tiny("llama"))
    cpu = sheet_for(plan, 2**30, 2, prefill_tokens=256)
    gpu = sheet_for(plan, 2**30, 2, prefill_tokens=256, host_set=2**30)
    assert cpu.fixed["prefill_kv"] == 2 * 256 * cpu.kv_per_token
    assert gpu.fixed["prefill_kv"] == 256 * gpu.kv_per_token


def test_on_a_cuda_gpu_the_live_allocation_is_the_larger_share_of_either_memory(make_tiny):
    plan = load_plan(make_tiny("llama"))
    s = sheet_for(plan, 4 * 2**30, 2, prefill_tokens=64, host_set=2**30)   # a 4 GiB GPU, a 1 GiB host
    p = m.Pass(0, 1, 1.0, 0.0, 1.0, 4, 0, 4, [], active_memory=1000 * MB, peak_memory=0, bytes_streamed=0,
               cache_memory=24 * MB, reader_memory=200 * MB, rss=200 * MB, cgroup_usage=None)
    assert live_allocation(p, others=100 * MB, runtime=100 * MB, sheet=s) == 1024 * MB   # MLX's, on the GPU
    p.cgroup_usage = 512 * MB                                 # half the host's: as half the GPU's
    assert live_allocation(p, others=100 * MB, runtime=100 * MB, sheet=s) == 2048 * MB
    s = sheet_for(plan, 4 * 2**30, 2, prefill_tokens=64, host_set=2**30, fraction=0.9, host_fraction=0.78)
    p.cgroup_usage = int(0.78 * 2**30)                        # the host at its budget line: the GPU's at its own
    assert abs(live_allocation(p, others=100 * MB, runtime=100 * MB, sheet=s) - s.budget) <= 8


def test_a_draft_models_weights_are_fixed_and_its_kv_priced_with_every_row(make_tiny):
    plan, draft = load_plan(make_tiny("llama")), load_plan(make_tiny("qwen2"))
    alone, both = (sheet_for(plan, 2**30, 4, prefill_tokens=64, draft=d) for d in (None, draft))
    c = draft.config
    assert both.fixed["draft"] == draft.total_bytes // 2 * 4 and alone.fixed["draft"] == 0   # bf16 stored, f32 computed
    assert both.draft_kv_per_token == c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * draft.kv_heads_and_dim[1] * 4
    assert both.cost(3, 100) == alone.cost(3, 100) + 3 * 100 * both.draft_kv_per_token
    assert both.kv_budget // both.slot(256, 256) < alone.kv_budget // alone.slot(256, 256)   # fewer rows a pass
