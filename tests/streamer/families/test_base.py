"""Weight names: a tensor missing from the files, or one the model does not have, is one sentence."""

import shutil

import mlx.core as mx
import pytest

from spill.errors import SpillError
from spill.streamer.core import Streamer


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
