"""Weight names: a tensor missing from the files, or one the model does not have, is one sentence. A SwiGLU split
over CPU streams changes no bit of the output."""

import os
import shutil

import mlx.core as mx
import pytest

from spill.errors import SpillError
from spill.streamer.core import Row, Streamer


def _edit(make_tiny, tmp_path, drop=(), add=()):
    """A copy of the tiny llama with tensors dropped from, or added to, its one safetensors file."""
    folder = tmp_path / "m"
    shutil.copytree(make_tiny("llama"), folder)
    weights = mx.load(str(folder / "model.safetensors"))
    for name in drop:
        del weights[name]
    for name in add:
        weights[name] = mx.zeros((4,), dtype=mx.bfloat16)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("drop, named", [
    (["model.layers.2.mlp.up_proj.weight"], "model.layers.2.mlp.up_proj.weight"),
    (["model.norm.weight"], "model.norm.weight"),
    (["model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.weight"],
     "model.layers.1.self_attn.k_proj.weight (and 1 more)"),
])
def test_a_missing_tensor_is_named(make_tiny, tmp_path, drop, named):
    folder = _edit(make_tiny, tmp_path, drop=drop)
    with pytest.raises(SpillError) as err:
        Streamer(folder)
    assert str(err.value) == (f"model folder {folder}: the weights have no tensor {named}, which a llama "
                              "model needs; the files are incomplete: re-download the model")


@pytest.mark.parametrize("extra", ["model.layers.3.mlp.extra.weight", "model.final_bias"])
def test_an_extra_tensor_is_named(make_tiny, tmp_path, extra):
    folder = _edit(make_tiny, tmp_path, add=[extra])
    with pytest.raises(SpillError) as err:
        Streamer(folder)
    assert str(err.value) == (f"model folder {folder}: the weights hold tensor {extra}, which a llama model "
                              "does not have; check config.json's model_type or re-download the model")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3"])
def test_the_swiglu_split_over_cpu_streams_gives_the_same_logits_bit_for_bit(make_tiny, monkeypatch, family):
    def run(streams: str):
        monkeypatch.setenv("SPILL_ACT_STREAMS", streams)
        engine = Streamer(make_tiny(family), dtype=mx.float32, keep_logits=True, prefill_chunk=16)
        for k in range(24):   # 24 rows: over the split's 16 with two streams
            engine.add(Row(f"r{k}", [(7 * k + j) % 50 + 3 for j in range(3 + k % 5)], 4))
        logits = []
        while not engine.idle:
            logits += [(e.row_id, e.logits.tobytes()) for e in engine.step().emitted]
        engine.close()
        return sorted(logits)

    entered = []
    stream = mx.stream
    monkeypatch.setattr(mx, "stream", lambda s: entered.append(s) or stream(s))
    whole = run("1")
    assert not entered
    split = run("2")
    assert entered and split == whole and len(whole) == 24 * 4


def test_adapters_share_the_processs_cpu_streams(make_tiny, monkeypatch):
    """Each MLX CPU stream is a thread for the life of the process: a group loading model after model makes none anew."""
    monkeypatch.setenv("SPILL_ACT_STREAMS", "2")
    first, second = Streamer(make_tiny("llama")), Streamer(make_tiny("qwen2"))
    made = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
    third = Streamer(make_tiny("llama"))
    assert first.adapter.streams == second.adapter.streams == third.adapter.streams and len(first.adapter.streams) == 2
    assert made is None or len(os.listdir("/proc/self/task")) <= made
    for engine in (first, second, third):
        engine.close()
