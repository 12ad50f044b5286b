"""Calibration: its key, its store, its probes and the admission actor's hook."""

import os
import shutil

import pytest
import structlog

from spill import messages as m
from spill.admission import calibration as cal
from spill.admission import probes
from spill.admission.calibration import Calibration, Calibrator, model_key, open_calibration
from spill.admission.passmodel import Observation, PassModel, PassShape


class FakeClock:
    """time.perf_counter for the probes and the streamer, moved only by the costs a test injects: a probe
    then measures those costs exactly, however busy the machine is (the +-30% bounds failed under load)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):   # monotonic, time: the real clock's
        import time
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch):
    from spill.streamer import core, reader
    fake = FakeClock()
    for module in (probes, core, reader):
        monkeypatch.setattr(module, "time", fake)
    return fake


def test_the_model_key_follows_the_content_not_the_path(make_tiny, tmp_path):
    bf16 = make_tiny("llama")
    copy = tmp_path / "copy"
    shutil.copytree(bf16, copy)
    assert model_key(copy) == model_key(bf16)
    assert model_key(make_tiny("llama", dtype="float32")) != model_key(bf16)
    assert model_key(make_tiny("qwen2")) != model_key(bf16)


def test_a_stored_calibration_is_used_only_for_its_own_key(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    c = Calibration("a|float32|cpu|m1", PassModel(bandwidth=2e9, per_row_s=0.01), name="x")
    c.observe(Observation(4, 0, 10, 1000, seconds=1.0, wait_s=0.1, compute_s=0.8))
    c.save()
    back = Calibration.load("a|float32|cpu|m1")
    assert back.seen == 1 and back.passes == c.passes and back.prior == c.prior
    assert Calibration.load("b|float32|cpu|m1") is None
    cal.store_path("c|float32|cpu|m1").write_text(cal.store_path("a|float32|cpu|m1").read_text())
    assert Calibration.load("c|float32|cpu|m1") is None      # a file renamed by hand names another key
    cal.store_path("d|x|y|z").write_text("{not json")
    assert Calibration.load("d|x|y|z") is None
    import json
    old = json.loads(cal.store_path("a|float32|cpu|m1").read_text())
    del old["format"]            # stored before a pass's prompt keys counted its own chunk: probed anew
    cal.store_path("a|float32|cpu|m1").write_text(json.dumps(old))
    assert Calibration.load("a|float32|cpu|m1") is None


def test_the_read_probe_drops_the_files_from_the_page_cache_before_reading(make_tiny, monkeypatch):
    events = []
    real_fadvise, real_preadv = os.posix_fadvise, os.preadv
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, adv: (events.append(("drop", off, n)),
                                                                      real_fadvise(fd, off, n, adv))[1])
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, pos: (events.append(("read", pos)),
                                                             real_preadv(fd, bufs, pos))[1])
    files = cal.weight_files(make_tiny("llama", shard_size="1MB"))
    assert len(files) > 1
    rate = cal.read_probe(files)
    assert rate > 0
    reads = [i for i, e in enumerate(events) if e[0] == "read" and e[1] == 0]
    assert len(reads) == len(files)
    for i in reads:                           # every file: dropped whole just before its first read
        assert i > 0 and events[i - 1] == ("drop", 0, 0)


def test_first_use_probes_and_stores_then_later_uses_load(make_tiny, monkeypatch, tmp_path):
    folder = make_tiny("mistral")
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    probes = []
    monkeypatch.setattr(cal, "read_probe", lambda files: probes.append(files) or 1.5e9)
    first = open_calibration(folder)
    assert len(probes) == 1 and first.model.bandwidth == 1.5e9
    # the context term is fitted non-negative; on a loaded machine its share of a tiny model's pass can fit to 0
    assert first.model.per_row_s > 0 and first.model.fixed_s > 0 and first.model.per_context_token_s >= 0
    assert first.key.split("|")[1:3] == ["float32", "cpu"]
    again = open_calibration(folder)
    assert len(probes) == 1 and again.prior == first.prior


def test_the_calibration_learns_the_models_acceptance_from_passes_with_drafts(tmp_path, monkeypatch):
    import json
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    hook = Calibrator(structlog.get_logger())
    hook.cal = Calibration("a|float32|cpu|m1", PassModel(bandwidth=2e9, per_row_s=0.01))
    assert hook.cal.acceptance is None                        # no draft measured yet

    def report(drafted, accepted):
        return m.Pass(0, 1, seconds=0.5, wait_s=0.0, compute_s=0.45, decode_rows=3, prefill_tokens=0, emitted=3,
                      finished=[], active_memory=0, peak_memory=0, bytes_streamed=4096, drafted=drafted,
                      accepted=accepted, columns=5)
    hook.observe(PassShape(3, 0, 30, 4096), report([[1, 4], [2, 4], [3, 2]], [[1, 4], [2, 1]]))
    # tried: row 1 its 4 accepted; row 2 1 and the rejected one; row 3 the rejected first
    back = Calibration.load("a|float32|cpu|m1")
    assert back.acceptance == pytest.approx(5 / 7) and back.draft_counts["count"] == 7
    hook.reset("", draft=str(tmp_path / "draft"))            # a job with --draft: its passes are not the model's
    hook.observe(PassShape(3, 0, 30, 4096), report([[1, 4], [2, 3]], [[1, 4], [2, 1]]))
    again = Calibration.load("a|float32|cpu|m1")
    assert again.draft_counts["count"] == 7 and hook.cal.seen == 1
    pair = cal.model_key(tmp_path / "draft")                  # but the pair's acceptance: 5 of 6 tried
    assert again.acceptance_of(pair) == pytest.approx(5 / 6) and again.counts(pair)["count"] == 6
    for accepted in ([[1, 4]], []):                           # 300 passes accept every draft, then 300 none
        for _ in range(300):
            back.observe_drafts([[1, 4]], accepted)
    assert back.acceptance < 0.25 and back.draft_counts["count"] == 7 + 1200 + 300   # the last passes weigh most
    old = json.loads(cal.store_path("a|float32|cpu|m1").read_text())
    del old["drafts"]                                          # stored before acceptance was kept: none measured
    cal.store_path("a|float32|cpu|m1").write_text(json.dumps(old))
    assert Calibration.load("a|float32|cpu|m1").acceptance is None


def test_the_hook_refits_and_stores_after_each_pass_and_survives_a_bad_model(make_tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    monkeypatch.setattr(cal, "read_probe", lambda files: 2e9)
    folder = str(make_tiny("llama", seed=3))
    open_calibration(folder)           # the job's estimate stores it; admission only loads it
    hook = Calibrator(structlog.get_logger())
    hook.reset(folder)
    planned = PassShape(2, 16, 18, 4096)
    stats = m.Pass(0, 1, seconds=0.5, wait_s=0.0, compute_s=0.45, decode_rows=2, prefill_tokens=16, emitted=2,
                   finished=[], active_memory=0, peak_memory=0, bytes_streamed=4096, prefill_groups=1,
                   prefill_context=16 * 32)
    hook.observe(planned, stats)
    stored = Calibration.load(hook.cal.key)
    p = stored.passes[0]
    assert stored.seen == 1 and (p.prefill_tokens, p.prefill_groups, p.prefill_context) == (16, 1, 16 * 32)
    assert (p.decode_rows, p.context_tokens) == (2, 18)   # the rows that decoded in it, as the plan had them
    assert stored.model.overhead_s == pytest.approx(0.05)
    hook.reset(str(tmp_path / "no-such-model"))
    assert hook.cal is None
    hook.observe(planned, stats)       # nothing to refit, nothing raised


def test_the_refit_keeps_a_sample_of_older_passes_beside_the_last_ones(tmp_path, monkeypatch):
    """The 53-row mixed-length job ended in 500 passes of 8 rows or fewer: the refit kept only its last 200,
    priced a row at 0 s, and the same job's next estimate was 1.49x short. Here 300 passes of 40-60 rows, then
    300 of 8; the next job's 50-row pass must still be priced as the first 300 ran, after a store and a load."""
    import random
    from spill.admission.passmodel import PassShape
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    true = PassModel(bandwidth=2e9, fixed_s=0.01, packed_s=0.005, per_row_s=1e-3, per_context_token_s=1e-6)
    prior = PassModel(bandwidth=2e9, fixed_s=0.02, per_row_s=2e-4, per_context_token_s=3e-7)
    rnd, c = random.Random(0), Calibration("k", prior)
    for i in range(600):
        rows = rnd.randint(40, 60) if i < 300 else 8
        shape = PassShape(rows, 0, rows * (600 + i % 300 * 3), 0)
        compute = true.compute_s(shape) * rnd.uniform(0.97, 1.03)
        c.observe(Observation(**vars(shape), seconds=compute, wait_s=0.0, compute_s=compute))
    c.save()
    later = Calibration.load("k")
    big = PassShape(50, 0, 50 * 1200, 0)
    assert later.model.compute_s(big) == pytest.approx(true.compute_s(big), rel=0.1)
    assert later.seen == 600 and len(later.passes) == cal.HISTORY


def test_resident_passes_refit_the_compute_terms_too(make_tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    monkeypatch.setattr(cal, "read_probe", lambda files: 2e9)
    open_calibration(make_tiny("llama", seed=3))
    hook = Calibrator(structlog.get_logger())
    hook.reset(str(make_tiny("llama", seed=3)), resident=True)
    for i in range(3):   # a resident pass reads nothing: still a measure of compute and overhead
        hook.observe(PassShape(2, 0, 20, 0), m.Pass(0, i, seconds=0.5, wait_s=0.0, compute_s=0.45, decode_rows=2, prefill_tokens=0, emitted=2,
                           finished=[], active_memory=0, peak_memory=0, bytes_streamed=0))
    stored = Calibration.load(hook.cal.key)
    assert stored.seen == 3 and stored.model.overhead_s == pytest.approx(0.05)
    assert stored.model.bandwidth == 2e9    # no read-bound pass: the probe's bandwidth stays


def test_the_compute_probe_times_a_real_layer_of_the_model(make_tiny, monkeypatch):
    from spill.streamer.plan import load_plan
    import mlx.core as mx
    monkeypatch.setattr(probes, "_matmul_rates", lambda h, dtype: (1.0, 2.0))   # a matmul a second per weight
    plan = load_plan(make_tiny("qwen2"))
    m = probes.compute_probe(plan, mx.float32)
    assert 0 < m.fixed_s < 10 and 0 < m.per_prefill_token_s < 10     # from the layer's own timings
    assert 0 <= m.per_context_token_s < 10                              # attention too, not the matmul's 2048



def test_the_compute_probe_times_another_prefill_group_through_the_streamers_layer_call(make_tiny, monkeypatch, clock):
    """A group's cost is not the share of the weights its products read: on 2 cores (lean45) one more group
    cost ~0.5 s a pass with the MLP shared, ~1/2 of a decode pass. Here each group a layer call costs 0.1 s more."""
    import mlx.core as mx
    from spill.streamer.families.base import Adapter
    from spill.streamer.plan import load_plan
    plan = load_plan(make_tiny("qwen2"))
    real = probes.compute_probe(plan, mx.float32).per_product_s
    run_layer = Adapter.run_layer
    monkeypatch.setattr(Adapter, "run_layer", lambda self, i, hs, masks, caches: (
        clock.sleep(0.1 * len(hs)), run_layer(self, i, hs, masks, caches))[1])
    slow = probes.compute_probe(plan, mx.float32).per_product_s
    assert slow - real == pytest.approx(0.1 * plan.config["num_hidden_layers"], rel=0.01)


def test_another_prefill_groups_price_leaves_out_its_own_tokens(make_tiny, monkeypatch, clock):
    """lean45, 64 GSM8K rows streamed: the probe priced another group at 0.22-0.37 s, of which its 32 tokens were
    0.14-0.16 (they are priced per token too); two jobs' passes refitted it to 0.067. Here a layer call costs 1 ms a
    token, which the token's price must take and the group's not."""
    import mlx.core as mx
    from spill.streamer.families.base import Adapter
    from spill.streamer.plan import load_plan
    plan = load_plan(make_tiny("qwen2"))
    layers = plan.config["num_hidden_layers"]
    real = probes.compute_probe(plan, mx.float32)
    run_layer = Adapter.run_layer
    monkeypatch.setattr(Adapter, "run_layer", lambda self, i, hs, masks, caches: (
        clock.sleep(1e-3 * sum(h.shape[0] * h.shape[1] for h in hs)), run_layer(self, i, hs, masks, caches))[1])
    slow = probes.compute_probe(plan, mx.float32)
    assert slow.per_prefill_token_s - real.per_prefill_token_s == pytest.approx(1e-3 * layers, rel=0.05)
    assert abs(slow.per_product_s - real.per_product_s) < 0.05 * 32e-3 * layers


def test_the_compute_probe_prices_a_token_of_context_by_the_attention_that_reads_it(make_tiny, monkeypatch, clock):
    """lean45 on 2 vCPUs: priced from a matmul's rate, a token of context cost 1.8e-6 s a pass where the job's
    passes spent 1.4e-4 (MLX's CPU attention). Here attention costs 0.1 ms per column of keys 16 rows read (a
    decode step's attention split over CPU streams calls it once a share of the rows)."""
    import mlx.core as mx
    from spill.streamer.plan import load_plan
    sdpa = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: (clock.sleep(1e-4 * k.shape[2] * q.shape[0] / 16),
                                               sdpa(q, k, v, **kw))[1])
    plan = load_plan(make_tiny("qwen2"))
    m = probes.compute_probe(plan, mx.float32)
    per_row_token = 1e-4 / 16 * plan.config["num_hidden_layers"]   # 16 rows read each column
    assert m.per_context_token_s == pytest.approx(per_row_token, rel=0.01)


def test_the_compute_probe_prices_the_keys_a_prompt_token_scores_apart_from_the_token(make_tiny, monkeypatch, clock):
    """The 53-row mixed-length job (qwen3 small, resident): its prompts' passes cost 2.2x the first-use price, which
    had no price for the keys a prompt token scores (those its prompt cached, and its chunk's). Here attention
    costs 1 us per query token and key of each head's share (where it is timed: the 1,024-token prompt that
    fills the cache before the chunk is not), so the tokens' own price stays as it was."""
    import mlx.core as mx
    from spill.streamer.plan import load_plan
    plan = load_plan(make_tiny("qwen2"))
    heads, layers = plan.config["num_attention_heads"], plan.config["num_hidden_layers"]
    real = probes.compute_probe(plan, mx.float32)
    sdpa = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", lambda q, k, v, **kw: (
        clock.sleep(1e-6 * q.shape[0] * q.shape[1] / heads * q.shape[2] * k.shape[2] * (q.shape[2] <= 128)),
        sdpa(q, k, v, **kw))[1])
    slow = probes.compute_probe(plan, mx.float32)
    assert slow.per_prefill_context_s - real.per_prefill_context_s == pytest.approx(1e-6 * layers, rel=0.05)
    # unpriced, the 128-token prompt's keys would add 1e-6 * layers * 128 to each of its tokens
    assert abs(slow.per_prefill_token_s - real.per_prefill_token_s) < 0.5 * 1e-6 * layers * 128


def test_a_resident_job_has_no_read_to_hide_prefill_under(make_tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    monkeypatch.setenv("SPILL_PREFILL_TOKENS", "3000")
    monkeypatch.setattr(cal, "read_probe", lambda files: 1e3)   # a disk so slow that streaming allows a lot
    folder = str(make_tiny("llama", seed=3))
    open_calibration(folder)
    hook = Calibrator(structlog.get_logger())
    hook.reset(folder)
    assert hook.pace(0, 0, 0) > 3000
    hook.reset(folder, resident=True)
    assert hook.pace(0, 0, 0) == 3000


def test_the_first_use_probe_leaves_nothing_in_mlx_buffer_cache(make_tiny, monkeypatch, tmp_path):
    """The probe runs in the coordinator (the estimate) and in admission: its freed buffers must not
    stay cached for the group's life (373 MiB for a 1b model, which got the coordinator OOM-killed in
    a 1 GiB cgroup before the first pass)."""
    import mlx.core as mx
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cal, "read_probe", lambda files: 1e9)
    open_calibration(make_tiny("llama"))
    assert mx.get_cache_memory() == 0


def test_the_first_use_model_prices_what_a_pass_spends_beside_its_layers_math(make_tiny, monkeypatch, tmp_path, clock):
    """The demo's first estimate said 9 s where its job took 22: timing one layer's math missed what each
    pass spends beside it (0.08 s a pass against 0.035 priced). Here loading a layer costs 10 ms."""
    import statistics
    from spill.admission.passmodel import PassShape
    from spill.streamer.core import Row, Streamer
    from spill.streamer.families.base import Adapter
    load = Adapter.load_layer
    monkeypatch.setattr(Adapter, "load_layer", lambda self, i, w: (clock.sleep(0.01), load(self, i, w))[1])
    folder = make_tiny("qwen2", dtype="float32")
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    monkeypatch.setattr(cal, "read_probe", lambda files: 2e9)
    model = open_calibration(folder).model
    streamer = Streamer(folder, prefill_chunk=512)
    try:
        for i in range(4):
            streamer.add(Row(i, list(range(1, 33)), 6))
        streamer.step()   # the prompts
        ratios = [model.compute_s(PassShape(4, 0, 4 * (34 + k), r.bytes_streamed)) / r.compute_s
                  for k, r in enumerate(streamer.step() for _ in range(4))]
    finally:
        streamer.close()
    assert statistics.median(ratios) == pytest.approx(1.0, rel=0.05), ratios


def test_the_first_use_bandwidth_is_the_reads_inside_the_probes_passes_when_slower(make_tiny, monkeypatch, tmp_path):
    """lean45 on 2 vCPUs: the cold probe read 1.16 GB/s, its passes' reads 0.65-0.8, and the first estimate
    priced the 30-row job at 16.5 min where it took ~28."""
    folder = make_tiny("qwen2", dtype="float32")
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    monkeypatch.setattr(cal, "read_probe", lambda files: 1.16e9)
    gib = 1 << 30
    passes = [Observation(0, 256, 0, gib, 8.0, 0.2, 7.8, read_s=1.5), Observation(16, 0, 272, gib, 2.0, 1.0, 1.0, read_s=1.4),
              Observation(1, 0, 18, gib, 1.9, 1.4, 0.5, read_s=1.3)]
    monkeypatch.setattr(cal, "pass_probe", lambda folder, dtype, kv=None, rows=16: passes)
    model = open_calibration(folder).model
    assert model.bandwidth == pytest.approx(gib / 1.4)
    assert model.read_tail_s == pytest.approx(0.6)   # what the two read-bound passes ran past their reads
    small = [Observation(**{**vars(p), "bytes_streamed": 1 << 20}) for p in passes]   # a tiny model's pass: its calls
    monkeypatch.setattr(cal, "pass_probe", lambda folder, dtype, kv=None, rows=16: small)
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "other"))
    assert open_calibration(folder).model.bandwidth == 1.16e9


def test_the_hook_never_probes_a_model_with_no_calibration_stored(make_tiny, monkeypatch, tmp_path):
    """The job's estimate calibrates a new model before the job starts; admission only loads what it stored,
    so it never runs a probe's streamer beside a job's (nor loads MLX for one)."""
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    monkeypatch.setattr(cal, "compute_probe", lambda *a: pytest.fail("admission probed"))
    hook = Calibrator(structlog.get_logger())
    hook.reset(str(make_tiny("llama", seed=5)))
    assert hook.cal is None and hook.pace(0, 0, 0, most=256) == 256


def test_quantized_kv_has_a_calibration_of_its_own_probed_through_its_own_attention(make_tiny, monkeypatch, tmp_path):
    """Attention over quantized KV runs other kernels at another cost (on the H100 a pass took 14% longer at
    8 bits, and a calibration shared with unquantized KV priced it 0.69x): each format is probed and refitted apart."""
    from spill.admission.calibration import stored_calibration
    from spill.coordinator.first_use import calibrated
    from spill.streamer import kvquant
    folder = make_tiny("llama")
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    monkeypatch.setattr(cal, "read_probe", lambda files: 1.5e9)
    monkeypatch.setattr(kvquant, "device_refusal", lambda *args: None)
    calls, real = [], kvquant.quantized_attention
    monkeypatch.setattr(kvquant, "quantized_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = open_calibration(folder)
    assert calls == [] and not calibrated(folder, (8, 32))
    quantized = open_calibration(folder, kv=(8, 32))
    assert len(calls) > 10   # the attention probe's steps and the pass probe's decodes, through the quantized pool
    assert plain.key.split("|")[1] == "float32" and quantized.key.split("|")[1] == "float32-kv8g32"
    assert stored_calibration(folder).key == plain.key and stored_calibration(folder, (8, 32)).key == quantized.key
    assert calibrated(folder) and calibrated(folder, (8, 32)) and not calibrated(folder, (4, 32))


def test_a_job_wider_than_the_calibration_has_seen_is_probed_at_its_batch(make_tiny, monkeypatch, tmp_path):
    """8-bit KV ran the three-tier job at 72 rows a pass, priced on a line the probe and the warm-up (at most 21
    rows) fitted: estimate 1.22x the job. A pass model fitted past a concave cost curve prices it wrong."""
    from tests.admission.test_probes import curve
    folder = make_tiny("llama")
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    monkeypatch.setattr(cal, "read_probe", lambda files: 1.5e9)
    monkeypatch.setattr(cal, "compute_probe", lambda *a: PassModel(1e9, per_context_token_s=7e-5))
    probed = []

    def pass_probe(folder, dtype, kv=None, rows=16):
        probed.append((kv, probes.probe_batch(rows)))
        decodes = [probes.probe_batch(rows)] * (probes.probe_batch(rows) > 16) * 3 + [16, 1]
        return [Observation(0, 16 * decodes[0], 0, 1, 5.0, 0.0, 5.0)] + [
            Observation(r, 0, 18 * r, 1, curve(r, 18 * r), 0.0, curve(r, 18 * r)) for r in decodes]
    monkeypatch.setattr(cal, "pass_probe", pass_probe)
    first = open_calibration(folder, kv=(8, 32), rows=20)   # a warm-up's 20 rows, then its passes
    for k in range(30):
        r = 1 + k % 20
        first.observe(Observation(r, 0, 300 * r, 1, curve(r, 300 * r), 0.0, curve(r, 300 * r)))
    first.save()
    job = PassShape(72, 0, 72 * 300, 1)
    assert first.model.compute_s(job) > 1.2 * curve(72, 72 * 300)
    wide = open_calibration(folder, kv=(8, 32), rows=72)
    assert probed == [((8, 32), 20), ((8, 32), 72)] and cal.widest(wide) == 72
    assert not any(p.prefill_tokens for p in wide.sample)   # the probe's decode passes alone
    assert wide.model.compute_s(job) == pytest.approx(curve(72, 72 * 300), rel=0.1)
    assert cal.Calibration.load(wide.key).model.compute_s(job) == pytest.approx(wide.model.compute_s(job))
    open_calibration(folder, kv=(8, 32), rows=80)   # within WIDER of the widest seen: no probe
    assert len(probed) == 2 and cal.stored_calibration(folder) is None   # the unquantized key: never probed
