"""Quantized decode pools (`--kv-bits`): mlx-lm's quantized cache is the gate, the pool holds what admission prices,
and rows moving between slots and pools keep their tokens."""

import mlx.core as mx
import pytest

from spill.errors import SpillError
from spill.streamer.check import run_check
from spill.streamer.core import Row, Streamer
from spill.streamer.kvquant import QuantPool

from .test_core import PROMPTS, _drive

cpu_default = pytest.mark.skipif(mx.default_device() == mx.gpu, reason="written for the CPU's float32 default")


@cpu_default
@pytest.mark.parametrize("family,bits", [("qwen2", 4), ("mistral", 8)])   # llama: tests/coordinator/test_cli.py
def test_check_passes_against_mlx_lms_quantized_cache(make_tiny, family, bits):
    report = run_check(make_tiny(family), n=3, max_tokens=4, prefill_chunk=16, kv_bits=bits, kv_group_size=32)
    assert report.passed, [(r.id, r.max_logit_diff, r.first_disagreement) for r in report.failures()]
    step = (4 * 2 ** -23 + 64 * 2 ** -23 + 2 ** -bits) * report.scale
    assert report.spread > 0 and report.tolerance == pytest.approx(max(step, 2 * report.spread))
    assert report.max_logit_diff <= 1e-4 and report.identical == 3   # the same kernels on the same values


@pytest.mark.slow   # the real model's check: ~1-2 min of CPU
@cpu_default
def test_on_the_real_model_8_bit_kv_passes_within_twice_mlx_lms_own_spread(smollm2):
    """30 real layers carry a KV value rounded the other way on: mlx-lm's own 8-bit logits move ~0.4 when every weight
    moves by a rounding step, far past one KV step at the largest logit (~0.14), and the tolerance allows for it."""
    report = run_check(smollm2, n=20, max_tokens=16, kv_bits=8, kv_group_size=64)
    assert report.passed, [(r.id, r.max_logit_diff, r.first_disagreement) for r in report.failures()]
    assert 2 * report.spread > (4 + 64) * 2 ** -23 * report.scale + 2 ** -8 * report.scale
    assert report.tolerance == 2 * report.spread and report.identical >= 18


def test_rows_leaving_growing_and_shrinking_quantized_pools_keep_their_tokens(make_tiny):
    """Rows that leave (the last slots move down), a pool outgrown (copied as stored) and rows of two widths give
    each row the tokens it has run alone at the same KV format."""
    folder, kv = make_tiny("llama"), dict(kv_bits=4, kv_group_size=32)
    s = Streamer(folder, prefill_chunk=8, **kv)
    s.reserve([[2, 256], [1, 512]])
    schedule = {0: [("a", PROMPTS[0], 256), ("b", PROMPTS[2], 512)], 1: [("c", PROMPTS[1], 256)],
                3: [("d", PROMPTS[3], 256), ("e", PROMPTS[4], 512)]}
    out, lens, passes = {}, {}, 0
    while passes <= max(schedule) or not s.idle:
        for rid, prompt, width in schedule.get(passes, []):
            lens[rid] = 3 + 2 * len(out)
            s.add(Row(rid, prompt, lens[rid], width=width))
            out[rid] = []
        for e in s.step().emitted:
            if e.finish != "stop":
                out[e.row_id].append(e.token)
        assert all(isinstance(p, QuantPool) and p.caches[0].keys[0].dtype == mx.uint32 for p in s.pools.values())
        passes += 1
    for rid, prompt, _ in [r for p in sorted(schedule) for r in schedule[p]]:
        alone = _drive(Streamer(folder, prefill_chunk=8, **kv), {0: [(rid, prompt)]}, max_tokens=lens[rid])
        assert out[rid] == alone[rid][0], rid


@pytest.mark.parametrize("bits,group,why", [
    (3, 64, "^--kv-bits 3 is not one of 8, 4; pick one or leave it out"),
    (8, 48, "^--kv-group-size 48 is not one of 32, 64, 128; pick one of them$"),
    (8, 64, "^--kv-group-size 64 does not divide the model's head dimension 32; use --kv-group-size 32$")])
def test_a_kv_format_the_model_cannot_take_is_one_sentence(make_tiny, bits, group, why):
    with pytest.raises(SpillError, match=why):
        Streamer(make_tiny("llama"), kv_bits=bits, kv_group_size=group)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_pool_allocates_exactly_what_the_sheet_prices_for_it(make_tiny, bits):
    """The pool's packed values, scales and biases are the bytes admission prices a slot's tokens at (kv_fields)."""
    from spill.admission.prices import sheet_for
    folder = make_tiny("llama")
    s = Streamer(folder, prefill_chunk=64, kv_bits=bits, kv_group_size=32)
    s.reserve([[3, 256]])
    s.add(Row("a", PROMPTS[0], 4, width=256))
    s.step()
    pool = s.pools[256]
    held = sum(x.nbytes for c in pool.caches for kv in (c.keys, c.values) for x in kv)
    sheet = sheet_for(s.plan, 2**30, 4, prefill_tokens=512, kv=(bits, 32))   # float32 on the CPU
    unquantized = sheet_for(s.plan, 2**30, 4, prefill_tokens=512)
    assert held == 3 * 256 * sheet.kv_per_token
    assert sheet.kv_per_token == unquantized.kv_per_token * (bits + 2 * 32 // 32) // 32   # 32 floats -> bits + 2 scales
    assert sheet.prefill_kv([5, 9]) == unquantized.prefill_kv([5, 9])   # prompts' KV stays unquantized until it joins
    s.close()



def test_drafts_on_a_quantized_pool_stay_in_the_slot_admission_priced(make_tiny):
    """A row's drafts write KV past its length but inside its slot (prompt + max_tokens, at the quantized bytes): the
    pool holds what the sheet prices pass after pass, its last drafts cut to the room left."""
    from spill.admission.prices import sheet_for
    s = Streamer(make_tiny("llama", "float32"), dtype=None, kv_bits=8, kv_group_size=32)
    s.reserve([[2, 32]])
    s.add(Row("a", [7, 8, 9] * 4, 20, width=32))   # a repeating prompt: lookup drafts it
    price, accepted = sheet_for(s.plan, 2**30, 4, prefill_tokens=512, kv=(8, 32)).kv_per_token, 0
    while not s.idle:
        accepted += sum(s.step({"a": 8}).accepted.values())
        for pool in s.pools.values():
            assert sum(x.nbytes for c in pool.caches for kv in (c.keys, c.values) for x in kv) == 2 * 32 * price
    assert accepted > 0
    s.close()


def _cuda_like(monkeypatch, runs):
    """mx.quantized_matmul as MLX 0.32's CUDA backend has it: no implementation outside the (bits, group) in `runs`."""
    from spill.streamer import kvquant
    real = mx.quantized_matmul

    def matmul(*args, group_size, bits, **kw):
        if (bits, group_size) not in runs:
            raise RuntimeError("[quantized_matmul] No implementation for problem shape: 1x3x64x8, transpose: true")
        return real(*args, group_size=group_size, bits=bits, **kw)
    monkeypatch.setattr(kvquant.mx, "quantized_matmul", matmul)
    monkeypatch.setattr(kvquant, "_RUNS", {})
    return kvquant


def test_a_format_whose_attention_mlx_cannot_run_here_names_a_group_size_that_runs(monkeypatch):
    """The streamer runs the quantized attention on small shapes before it admits a row (not a crash mid-pass),
    and where a format fails names one that runs on this device."""
    from types import SimpleNamespace
    kvquant = _cuda_like(monkeypatch, {(8, 32), (4, 32)})
    plan = SimpleNamespace(kv_heads_and_dim=(2, 64), config={"num_attention_heads": 4})
    assert kvquant.device_refusal(8, 32, plan, mx.float32) is None
    why = kvquant.device_refusal(8, 64, plan, mx.float32)
    assert why.startswith("--kv-bits 8 --kv-group-size 64: MLX ") and why.endswith("; use --kv-group-size 32")
    assert "cannot run attention over KV in that format ([quantized_matmul] No implementation" in why


def test_a_streamer_refuses_a_format_no_group_of_which_runs_here_in_one_sentence(make_tiny, monkeypatch):
    _cuda_like(monkeypatch, {(8, 32)})
    with pytest.raises(SpillError, match=r"^--kv-bits 4 --kv-group-size 32: .*; leave --kv-bits out$"):
        Streamer(make_tiny("llama"), kv_bits=4, kv_group_size=32)
    Streamer(make_tiny("llama"), kv_bits=8, kv_group_size=32).close()


def test_a_device_that_attends_one_query_a_row_only_drafts_nothing_there_and_says_so_once(make_tiny, monkeypatch):
    """Where MLX runs quantized attention for a token a row but not for a chunk of drafts, the pools take a token a
    row a pass: --speculate K gives the same tokens without drafts and says so once in the log; auto says nothing."""
    from structlog.testing import capture_logs

    from spill.typed import AUTO_DRAFTS

    from .test_speculate import drive
    real = mx.quantized_matmul

    def matmul(x, *args, **kw):
        if x.shape[-2] > 1:   # queries (or their scores) of a chunk
            raise RuntimeError("[quantized_matmul] No implementation for problem shape: 2x4x8")
        return real(x, *args, **kw)
    from spill.streamer import kvquant
    monkeypatch.setattr(kvquant.mx, "quantized_matmul", matmul)
    monkeypatch.setattr(kvquant, "_RUNS", {})
    folder, kv = make_tiny("llama", "float32"), dict(kv_bits=8, kv_group_size=32)
    plain = drive(folder, 0, speculate=4, kv=kv)
    with capture_logs() as said:
        spec = drive(folder, 4, speculate=4, kv=kv)
    assert spec.out == plain.out and spec.passes == plain.passes and not any(spec.accepted.values())
    (line,) = [e for e in said if e["log_level"] == "warning"]
    assert line["event"] == "drafts off: this device cannot run attention over quantized KV for a chunk of drafts"
    assert (line["speculate"], line["kv_bits"], line["kv_group_size"]) == (4, 8, 32)
    assert line["error"].startswith("[quantized_matmul] No implementation")
    with capture_logs() as said:
        assert drive(folder, 4, speculate=AUTO_DRAFTS, kv=kv).out["a"] == plain.out["a"]   # greedy
    assert not [e for e in said if e["log_level"] == "warning"]


def test_mlx_lms_reference_failing_on_a_format_is_one_sentence_not_a_traceback(make_tiny):
    """The check's reference runs mlx-lm's own quantized cache in a process of its own; where mlx-lm cannot run the
    format (here: a group size that does not divide the head dimension), the check says so in one sentence."""
    from spill.streamer.reference import resident_side
    with pytest.raises(SpillError, match=r"^mlx-lm's resident reference failed on .* nothing to compare against"):
        resident_side(make_tiny("llama"), "float32", 1, 2, 8, kv={"kv_bits": 8, "kv_group_size": 64})
