"""Attention over the decode pools: a chunk of drafts attends by three ops where the device's fused kernel would
plan each new shape (a CUDA GPU), with the fused kernel's result and the same tokens."""

import mlx.core as mx
import numpy as np
import pytest

from spill import platform
from spill.errors import SpillError
from spill.streamer import attention

from .test_speculate import drive


@pytest.mark.parametrize("heads, kv", [(4, 4), (8, 2)])   # one KV head a query head, and four sharing one
def test_the_ops_give_the_fused_kernels_attention_over_a_masked_chunk(heads, kv):
    rows, t, span, dim = 3, 5, 37, 16
    q, k, v = (mx.random.normal(shape, key=mx.random.key(i)) for i, shape in
               enumerate([(rows, heads, t, dim), (rows, kv, span, dim), (rows, kv, span, dim)]))
    lens = np.array([4, 20, 32])   # row j's position i sees columns 0..lens[j] + i
    mask = mx.array(np.arange(span)[None, None, :] <= (lens[:, None, None] + np.arange(t)[None, :, None]))[:, None]
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask=mask)
    ops = attention.by_ops(q, k, v, scale=dim ** -0.5, mask=mask)
    assert ops.shape == fused.shape
    assert np.allclose(np.array(ops), np.array(fused), atol=1e-5)
    additive = mx.where(mask, 0.0, -1e9)
    assert np.allclose(np.array(attention.by_ops(q, k, v, scale=dim ** -0.5, mask=additive)), np.array(fused),
                       atol=1e-5)


def test_with_ops_a_drafting_pass_attends_by_ops_and_keeps_every_token(make_tiny, monkeypatch):
    folder = make_tiny("llama", "float32")
    calls = []
    by_ops = attention.by_ops
    monkeypatch.setattr(attention, "by_ops", lambda q, *a, **kw: calls.append(q.shape) or by_ops(q, *a, **kw))
    monkeypatch.setenv("SPILL_CHUNK_ATTENTION", "fused")
    fused = drive(folder, 4)
    assert calls == []
    monkeypatch.setenv("SPILL_CHUNK_ATTENTION", "ops")
    ops = drive(folder, 4)
    assert calls and all(1 < shape[2] <= attention.BY_OPS for shape in calls)   # a one-token step stays fused
    assert any(shape[2] == 5 for shape in calls)   # the chunks: a row's token and its 4 drafts
    assert ops.out == fused.out == drive(folder, 0).out


def test_the_ops_are_the_default_on_a_cuda_gpu_only(monkeypatch):
    monkeypatch.delenv("SPILL_CHUNK_ATTENTION", raising=False)
    monkeypatch.setattr(platform, "on_cuda", lambda: True)
    assert platform.chunk_attention() == "ops"
    monkeypatch.setattr(platform, "on_cuda", lambda: False)
    assert platform.chunk_attention() == "fused"
    monkeypatch.setenv("SPILL_CHUNK_ATTENTION", "flash")
    with pytest.raises(SpillError, match="fused or ops"):
        platform.chunk_attention()


def test_with_ops_a_draft_models_steps_still_propose_the_targets_own_tokens(make_tiny, monkeypatch):
    from .test_draft import drive as with_draft
    folder = make_tiny("llama", "float32")
    plain = with_draft(folder, 0)
    monkeypatch.setenv("SPILL_CHUNK_ATTENTION", "ops")
    spec = with_draft(folder, 4, draft=folder)   # the target as its own draft: every draft is its next token
    assert spec.out == plain.out and spec.accepted == spec.drafted > 0
