"""`spill check`'s teacher-forced gate: the dtype it computes in, its tolerance, and that it can fail."""

import mlx.core as mx
import numpy as np
import pytest

from spill.errors import SpillError
from spill.streamer import check, speculate
from spill.streamer.check import run_check
from spill.streamer.core import Row, Streamer
from spill.streamer.families.base import Adapter

# These expect the CPU's default (float32, or bf16 forced on the CPU); a GPU computes in the stored dtype.
cpu_default = pytest.mark.skipif(mx.default_device() == mx.gpu, reason="written for the CPU's float32 default")


@cpu_default
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_bfloat16_on_the_cpu_passes_teacher_forced(make_tiny, family):
    report = run_check(make_tiny(family), n=6, max_tokens=6, prefill_chunk=16, dtype="bfloat16")
    assert (report.dtype, report.device, report.derived) == ("bfloat16", "cpu", True)
    assert report.tolerance == pytest.approx((check.ULPS * 2 ** -7 + check.ULPS_F32 * 2 ** -23) * report.scale)
    assert report.passed, [(r.id, r.max_logit_diff, r.first_disagreement) for r in report.failures()]
    assert all(r.forced_steps == len(r.ref_logits) > 0 for r in report.rows)
    assert report.agree == report.compared and report.compared + report.ties == sum(len(r.ref_logits) for r in report.rows)


@cpu_default
def test_float32_tolerance_is_far_tighter_and_rows_are_identical(make_tiny):
    report = run_check(make_tiny("llama"), n=4, max_tokens=6, prefill_chunk=16)
    assert report.dtype == "float32" and report.tolerance < 1e-4
    assert report.passed and report.identical == 4 and report.ties == 0


@cpu_default
def test_teacher_tokens_are_fed_instead_of_the_sampled_ones(make_tiny):
    """The logits of step 2 are the resident model's on prompt + the first two teacher tokens."""
    from mlx_lm.utils import load
    folder, prompt, teacher = make_tiny("llama"), [5, 9, 13, 2, 7], (300, 301, 302)
    s = Streamer(folder, keep_logits=True)
    s.add(Row("t", prompt, len(teacher), teacher=teacher))
    logits = []
    while not s.idle:
        logits += [e.logits for e in s.step().emitted]
    s.close()
    model, _ = load(str(folder))
    model.set_dtype(mx.float32)
    want = np.array(model(mx.array([prompt + list(teacher[:2])]))[0, -1])
    assert len(logits) == 3
    np.testing.assert_allclose(logits[2], want, atol=1e-4)


@cpu_default
def test_logits_that_drift_past_the_tolerance_fail(make_tiny, monkeypatch):
    head = Adapter.head
    monkeypatch.setattr(Adapter, "head", lambda self, h: head(self, h) + 1e-3)
    report = run_check(make_tiny("qwen2"), n=3, max_tokens=4, prefill_chunk=16)
    assert not report.passed and len(report.failures()) == 3
    assert report.max_logit_diff == pytest.approx(1e-3, rel=0.05) and report.agree == report.compared


@cpu_default
def test_a_token_that_is_not_the_argmax_of_its_logits_fails(make_tiny, monkeypatch):
    """Logits within tolerance, but the streamer samples something else (token 3): caught by the argmax."""
    monkeypatch.setattr(speculate, "sample", lambda logits, samplers: [3] * len(samplers))
    report = run_check(make_tiny("qwen2"), n=2, max_tokens=4, prefill_chunk=16)
    assert report.max_logit_diff <= report.tolerance
    assert not report.passed and report.agree < report.compared
    assert {r.first_disagreement for r in report.failures()} == {0}


def test_an_unknown_dtype_is_one_sentence(make_tiny):
    with pytest.raises(SpillError, match="^--dtype 'bf16' is not one of bfloat16, float16, float32; pick one"):
        run_check(make_tiny("llama"), n=2, dtype="bf16")


@pytest.mark.skipif(not mx.is_available(mx.gpu), reason="no GPU here: MLX's GPU backend (Metal or CUDA) is absent")
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_check_on_the_gpu_in_the_stored_dtype_passes(make_tiny, family):
    report = run_check(make_tiny(family), n=6, max_tokens=6, prefill_chunk=16)   # the GPU is the default
    assert (report.dtype, report.device) == ("bfloat16", "gpu")
    assert report.passed, [(r.id, r.max_logit_diff, r.first_disagreement) for r in report.failures()]


def test_check_refuses_a_tokenizer_that_asks_for_its_repos_code_without_running_it(make_tiny, tmp_path, monkeypatch):
    from tests.tokenizer_worker.test_core import remote_code_model
    folder = remote_code_model(make_tiny("llama"), tmp_path)
    monkeypatch.setattr("builtins.input", lambda *a: "y")   # what a user at a terminal might answer
    with pytest.raises(SpillError, match=r"its tokenizer needs code from the model's repository \(auto_map\)"):
        run_check(folder, n=2, max_tokens=2)
    assert not (folder / "RAN").exists()


@cpu_default
def test_a_defect_in_spill_s_attention_fails_the_check(make_tiny, monkeypatch):
    """Streaming swaps the attention of mlx-lm's model module for its own (pooled, split); a reference run in this
    process would run that swapped attention too and pass whatever it computes. Skewed here, the gate catches it."""
    from mlx_lm.models import base, llama

    from spill.streamer.attention import pooled_attention
    def skewed(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
        return base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale * 1.05, mask=mask,
                                                 sinks=sinks)
    monkeypatch.setattr(llama, "scaled_dot_product_attention", pooled_attention(skewed))
    report = run_check(make_tiny("llama"), n=3, max_tokens=4, prefill_chunk=16)
    assert not report.passed and report.max_logit_diff > report.tolerance
