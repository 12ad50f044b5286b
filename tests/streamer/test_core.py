"""The streamer core against mlx-lm with the same weights resident."""

import pytest

from spill.errors import SpillError
from spill.streamer.check import run_check
from spill.streamer.core import Row, Streamer
from spill.streamer.sampling import SamplingParams


def _drive(streamer, schedule, max_tokens=8, **row_kw):
    """Add rows at the given passes; run to the end. Returns {row_id: (tokens, finish)}."""
    out, passes = {}, 0
    while passes <= max(schedule) or not streamer.idle:
        for rid, prompt in schedule.get(passes, []):
            streamer.add(Row(rid, prompt, max_tokens, **row_kw))
            out[rid] = ([], None)
        for e in streamer.step().emitted:
            toks, _ = out.get(e.row_id, ([], None))
            if e.finish != "stop":
                toks.append(e.token)
            out[e.row_id] = (toks, e.finish)
        passes += 1
    return out


PROMPTS = [[5, 9, 13, 2, 7], [30, 31], list(range(40, 90)), [3] * 17, [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype,shard", [("bfloat16", None), ("float32", "64KB")])
def test_identity_with_resident_mlx_lm(make_tiny, family, dtype, shard):
    rows = run_check(make_tiny(family, dtype, shard), n=8, max_tokens=8, prefill_chunk=16).rows
    assert [r.got for r in rows] == [r.expected for r in rows]
    assert all(len(r.got) > 0 for r in rows)
    assert max(r.max_logit_diff for r in rows) <= 1e-4


def test_rows_joining_at_different_passes_match_rows_run_alone(make_tiny):
    folder = make_tiny("llama")
    together = _drive(Streamer(folder, prefill_chunk=8),
                      {0: [("a", PROMPTS[0]), ("b", PROMPTS[1])], 2: [("c", PROMPTS[2])], 3: [("d", PROMPTS[3])]})
    for rid, prompt in zip("abcd", PROMPTS):
        alone = _drive(Streamer(folder, prefill_chunk=8), {0: [(rid, prompt)]})
        assert together[rid] == alone[rid]


def test_the_decode_rows_and_every_prefill_group_share_one_mlp_product_a_layer(make_tiny, monkeypatch):
    """Each separate product through a layer's weights costs a CPU their trip through memory again (2 cores,
    lean45: ~1 s a pass a product). The tokens stay those of rows run alone (the test above)."""
    s = Streamer(make_tiny("llama"), prefill_chunk=8)
    mlp, calls = type(s.adapter.layers[0].mlp), []
    call = mlp.__call__
    monkeypatch.setattr(mlp, "__call__", lambda self, x: (calls.append(x.shape), call(self, x))[1])
    s.add(Row("a", PROMPTS[0], 4))
    s.step()                                   # a decodes from the next pass on
    s.add(Row("b", PROMPTS[1], 4))
    s.add(Row("c", PROMPTS[2], 4))             # 2 and 50 tokens: two prefill groups
    calls.clear()
    report = s.step()
    assert report.prefill_groups == 2
    assert [shape[0] for shape in calls] == [1 + 2 + 8] * len(s.adapter.layers)   # a's token, b's prompt, c's chunk


def test_chunked_prefill_matches_unchunked(make_tiny):
    folder = make_tiny("qwen2")
    schedule = {0: [("long", PROMPTS[2]), ("short", PROMPTS[0])]}
    chunked = _drive(Streamer(folder, prefill_chunk=7), schedule)
    whole = _drive(Streamer(folder, prefill_chunk=1024), schedule)
    assert chunked == whole


def test_a_pass_reports_the_keys_each_chunks_tokens_attend_to(make_tiny):
    """A chunk late in a long prompt costs more than an early one (`benchmarks/prefill_groups.py --context`), and a long
    chunk more per token than a short one: a pass reports its prompt tokens times the keys each scores (the
    prompt cached before the chunk, and the chunk itself), for a price to be fitted."""
    s = Streamer(make_tiny("llama"), prefill_chunk=20)
    s.add(Row("long", list(range(40, 90)), 2))
    reports = [s.step() for _ in range(3)]
    assert [(r.prefill_tokens, r.prefill_context) for r in reports] == [(20, 20 * 20), (20, 20 * 40), (10, 10 * 50)]


def test_a_pace_shares_a_passs_prefill_tokens_out_and_changes_no_token(make_tiny):
    folder = make_tiny("qwen2")
    schedule = {0: [("a", list(range(40, 140))), ("b", [3] * 90)], 1: [("c", list(range(7, 57)))]}
    paced = Streamer(folder, prefill_chunk=512)
    paced.prefill_budget = 64        # the pace: 64 prompt tokens a pass, shared by the rows prefilling
    steps = []
    step = paced.step
    paced.step = lambda: steps.append(step()) or steps[-1]
    assert _drive(paced, schedule) == _drive(Streamer(folder, prefill_chunk=512), schedule)
    carried = [r.prefill_tokens for r in steps if r.prefill_tokens]
    assert max(carried) == 32 * 3 and len(carried) >= 4   # 3 rows at 32 tokens (the least a row takes), not 512
    # a and b (of like length) came together: one group (its own attention); c came a pass later
    assert [r.prefill_groups for r in steps if r.prefill_tokens] == [1, 2, 2, 1]


def test_max_tokens_ends_a_row_with_length(make_tiny):
    out = _drive(Streamer(make_tiny("llama")), {0: [("a", PROMPTS[0]), ("b", PROMPTS[1])]}, max_tokens=5)
    assert [len(out[r][0]) for r in "ab"] == [5, 5]
    assert {out[r][1] for r in "ab"} == {"length"}


def test_eos_ends_a_row_and_leaves_the_others_alone(make_tiny):
    folder = make_tiny("llama")
    free = _drive(Streamer(folder), {0: [("a", PROMPTS[0]), ("b", PROMPTS[1])]}, max_tokens=6)
    eos = free["a"][0][2]  # a's third token becomes its end of sequence
    s = Streamer(folder)
    s.add(Row("a", PROMPTS[0], 6, eos_ids=frozenset({eos})))
    s.add(Row("b", PROMPTS[1], 6))
    out = _drive(s, {0: []}, max_tokens=6)
    first = free["a"][0].index(eos)
    assert out["a"] == (free["a"][0][:first], "stop")
    assert out["b"] == free["b"]


def test_finish_from_outside_removes_only_that_row(make_tiny):
    folder = make_tiny("mistral")
    free = _drive(Streamer(folder), {0: [("a", PROMPTS[0]), ("b", PROMPTS[4])]}, max_tokens=8)
    s = Streamer(folder)
    s.add(Row("a", PROMPTS[0], 8))
    s.add(Row("b", PROMPTS[4], 8))
    got, left = {"a": [], "b": []}, []
    while not s.idle:
        report = s.step()
        left += report.left
        for e in report.emitted:
            got[e.row_id].append(e.token)
            if e.row_id == "a" and len(got["a"]) == 3:
                s.finish("a")  # what the caller does when it sees a stop string
    assert got["a"] == free["a"][0][:3]
    assert got["b"] == free["b"][0]
    assert left == ["a", "b"]   # every row that leaves is reported once, however it ended


def test_a_row_finished_before_its_prefill_is_reported_as_left(make_tiny):
    s = Streamer(make_tiny("llama"))
    s.add(Row("a", PROMPTS[0], 4))
    s.add(Row("b", PROMPTS[1], 4))
    s.finish("a")
    assert s.step().left == ["a"]
    assert s.rows.keys() == {"b"}


def test_seeded_sampling_is_reproducible_across_batches(make_tiny):
    folder = make_tiny("llama")
    hot = dict(sampling=SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7))
    alone = _drive(Streamer(folder), {0: [("x", PROMPTS[0])]}, max_tokens=12, **hot)
    crowded = _drive(Streamer(folder), {0: [("y", PROMPTS[1]), ("x", PROMPTS[0])], 1: [("z", PROMPTS[3])]},
                     max_tokens=12, **hot)
    assert alone["x"] == crowded["x"]
    other = _drive(Streamer(folder), {0: [("x", PROMPTS[0])]}, max_tokens=12,
                   sampling=SamplingParams(temperature=1.0, seed=8))
    assert other["x"][0] != alone["x"][0]


def test_bad_rows_are_refused_with_a_sentence(make_tiny):
    s = Streamer(make_tiny("llama"))
    with pytest.raises(SpillError, match="empty prompt"):
        s.add(Row("a", [], 4))
    s.add(Row("a", [1, 2], 4))
    with pytest.raises(SpillError, match="already running"):
        s.add(Row("a", [1, 2], 4))


def test_unsupported_model_type_is_one_clear_sentence(make_tiny, tmp_path):
    import json
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(make_tiny("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "mamba"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpillError, match=r"mamba is a state-space or hybrid recurrent model: it has no KV cache"):
        Streamer(folder)


def test_a_preempted_row_leaves_with_its_kv_and_runs_again_from_its_prompt(make_tiny):
    folder = make_tiny("llama")
    free = _drive(Streamer(folder, prefill_chunk=8), {0: [("a", PROMPTS[0]), ("b", PROMPTS[2])]})
    s = Streamer(folder, prefill_chunk=8)
    s.add(Row("a", PROMPTS[0], 8))
    s.add(Row("b", PROMPTS[2], 8))       # 50 tokens: still prefilling after the first pass
    s.step()
    s.preempt(["a", "b"])
    report = s.step()
    assert sorted(report.preempted) == ["a", "b"] and report.left == [] and report.emitted == []
    assert s.idle
    assert _drive(s, {0: [("a", PROMPTS[0]), ("b", PROMPTS[2])]}) == free


def test_a_pass_reports_memory_and_faults(make_tiny):
    s = Streamer(make_tiny("llama"))
    s.add(Row("a", PROMPTS[0], 2))
    r = s.step()
    assert r.rss > 0 and r.active_memory > 0 and r.reader_memory == s.reader.buffer_bytes   # 0: read into MLX memory
    assert 0 < r.read_s <= r.seconds   # the reads, timed: the bandwidth they ran at
    assert r.minor_faults >= 0 and r.major_faults >= 0


def test_rows_of_a_narrow_pool_attend_over_their_own_span_not_the_widest_rows(make_tiny, monkeypatch):
    """Three-tier decode passes on a 2-core CPU spent ~1 s attending short rows over a long row's padding."""
    import mlx.core as mx
    folder = make_tiny("llama", dtype="float32")
    s = Streamer(folder, prefill_chunk=512)
    s.reserve([[2, 256], [2, 512]])
    s.add(Row("short", PROMPTS[0], 6, width=256))
    s.add(Row("long", list(range(40, 240)), 6, width=512))
    s.step()   # both prompts
    spans, real = [], mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: (spans.append((q.shape[0], k.shape[2])), real(q, k, v, **kw))[1])
    s.step()   # a decode pass of the two pools
    assert sorted(set(spans)) == [(1, 6), (1, 201)]   # each row over its prompt and this pass's token


def test_rows_in_the_last_slots_move_into_the_slots_rows_left_so_a_pass_computes_live_rows(make_tiny):
    """A pool computes every slot up to its last live row: the three-tier job's pools ran 15 rows for 10 alive."""
    folder = make_tiny("llama", dtype="float32")
    s = Streamer(folder, prefill_chunk=512)
    s.reserve([[4, 256]])
    out = {}
    for rid, n in (("a", 2), ("b", 2), ("c", 7), ("d", 7)):   # a and b hold the first slots and end first
        s.add(Row(rid, PROMPTS[0], n, width=256))
        out[rid] = []
    used = []
    while not s.idle:
        for e in s.step().emitted:
            out[e.row_id].append(e.token)
        used += [p.used for p in s.pools.values() if hasattr(p, "used")]
    assert used[:4] == [4, 2, 2, 2]
    alone = _drive(Streamer(folder, prefill_chunk=512), {0: [("c", PROMPTS[0])]}, max_tokens=7)
    assert out["c"] == out["d"] == alone["c"][0]


@pytest.mark.parametrize("family", ["llama", "gemma2"])   # gemma2's attention is its own, not the pooled one
def test_rows_that_move_or_join_write_into_their_pools_kv_not_a_copy_of_it(make_tiny, family):
    """The pass's decode group kept each layer's K and V it had fetched, and a row moved into a freed slot from a
    slice of the pool itself: either way a row moving or joining copied every layer's pool, 1-2 times. The
    three-tier job's live memory rose by 170-280 MiB at passes where rows ended, and it was preempted."""
    import mlx.core as mx
    folder = make_tiny(family, dtype="float32")
    s = Streamer(folder, prefill_chunk=512)
    s.reserve([[8, 512], [2, 256]])
    for rid, n in (("a", 3), ("b", 3), *((f"r{i}", 12) for i in range(4))):   # a, b hold the first slots, end first
        s.add(Row(rid, list(range(40, 240)), n, width=512))
    s.add(Row("short", PROMPTS[0], 12, width=256))
    active, peak = [], []
    for k in range(5):
        if k == 3:
            s.add(Row("late", list(range(40, 240)), 4, width=512))   # prefills beside the decode rows, then joins
        mx.reset_peak_memory()
        active.append(s.step().active_memory)
        peak.append(mx.get_peak_memory())
    pool = s.pools[512]
    kv = sum(c.keys.nbytes + c.values.nbytes for c in pool.caches)
    assert sum(r is not None for r in pool.rows[:5]) == 5 and pool.rows[5:] == [None] * 3   # r2, r3 moved down
    assert active[2] - active[1] < kv / 8 and active[3] - active[1] < kv / 8
    assert peak[2] - active[1] < kv / 2     # the pass that moved rows held no second pool at any time


def test_rows_that_end_on_their_first_token_never_take_a_slot(make_tiny):
    s = Streamer(make_tiny("llama"))
    s.add(Row("a", PROMPTS[0], 1))
    s.add(Row("b", PROMPTS[1], 1))
    report = s.step()
    assert sorted(report.left) == ["a", "b"] and not s.pools and s.idle


def test_a_prefill_holds_kv_for_its_prompts_width_only(make_tiny):
    s = Streamer(make_tiny("llama"), prefill_chunk=2)
    s.add(Row("a", PROMPTS[0], 4))
    s.add(Row("b", PROMPTS[1], 4))
    s.step()                                   # 2 of the 5 columns: still prefilling
    assert next(iter(s.prefills.values())).caches[0].keys.shape[2] == len(PROMPTS[0])   # not mlx-lm's 256-token step


def test_freed_buffers_go_back_to_the_os_after_every_pass(make_tiny, monkeypatch):
    # glibc kept MLX's freed buffers in the RSS: 35 MiB after a 512-token prefill (lean model), and a heap
    # of 425 MiB after 12 passes of three decode pools (lean45), which held admission above its guard line
    from spill.streamer import core
    calls = []
    monkeypatch.setattr(core, "release_heap", lambda: calls.append(1))
    s = Streamer(make_tiny("llama"))
    s.add(Row("a", [5, 6, 7], max_tokens=4))
    s.step()                       # prefill: the group joins the pool (MLX's cache emptied too)
    assert len(calls) == 1
    s.step()                       # decode only
    assert len(calls) == 2


def test_a_streamed_pass_starts_with_mlxs_cache_empty_so_each_freed_layer_fits_in_it(make_tiny, monkeypatch):
    """MLX's CPU cache keeps a freed buffer only while it fits under the limit and reuses it only at its own
    size. On lean45 (23 rows) what earlier passes left there kept every freed layer out, and each layer's
    memory was allocated and faulted in anew: 651k page faults a pass, passes 6.6 s against ~4."""
    import mlx.core as mx
    from spill.streamer.reader import WeightReader
    seen, start = [], WeightReader.start_pass
    monkeypatch.setattr(WeightReader, "start_pass", lambda self, order=None: (seen.append(mx.get_cache_memory()),
                                                                              start(self, order))[1])
    s = Streamer(make_tiny("llama"))
    s.set_cache_limit(64 << 20)
    s.add(Row("a", [5, 6, 7], max_tokens=4))
    s.step()
    left = mx.zeros((3 << 20,), mx.uint8)   # a buffer of a size no pass asks for again, freed into the cache
    mx.eval(left)
    del left
    assert mx.get_cache_memory() >= 3 << 20
    s.step()
    assert seen[-1] == 0
