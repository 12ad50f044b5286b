"""RoPE settings as transformers 5 saves them (under `rope_parameters` only) run as the same settings saved at the top
level; a setting the family's mlx-lm model would drop is refused in one sentence, never run with a default."""

import json
import shutil

import mlx.core as mx
import pytest

from spill.errors import SpillError
from spill.streamer.core import Row, Streamer

THETA, LOCAL = 123457.0, 4321.0   # no family's default: a setting that is dropped changes the logits


def _copy(make_tiny, tmp_path, family, name, edit) -> str:
    folder = tmp_path / name
    shutil.copytree(make_tiny(family), folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _flat(config):
    config["rope_theta"] = THETA
    if config["model_type"] == "gemma3_text":
        config["rope_local_base_freq"] = LOCAL


def _nested(config):
    """What transformers 5's save_pretrained writes for the same settings."""
    _flat(config)
    scaling = config.pop("rope_scaling", None) or {}
    params = {"rope_type": "default", **scaling, "rope_theta": config.pop("rope_theta")}
    if "partial_rotary_factor" in config:
        params["partial_rotary_factor"] = config.pop("partial_rotary_factor")
    if config["model_type"] == "gemma3_text":
        params = {"full_attention": params,
                  "sliding_attention": {"rope_type": "default", "rope_theta": config.pop("rope_local_base_freq")}}
    config["rope_parameters"] = params


def _logits(folder) -> list[bytes]:
    engine = Streamer(folder, dtype=mx.float32, keep_logits=True, prefill_chunk=64)
    for k in range(2):
        engine.add(Row(f"r{k}", [(5 * k + 3 * j) % 60 + 3 for j in range(40 + k)], 3))
    logits = []
    while not engine.idle:
        logits += [e.logits.tobytes() for e in engine.step().emitted]
    engine.close()
    return logits


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "phi3", "gemma2", "gemma3_text"])
def test_rope_parameters_saved_by_transformers_5_are_applied(make_tiny, tmp_path, family):
    """The llama's llama3 scaling and every family's theta (gemma3_text's local one too) move under rope_parameters."""
    flat = _copy(make_tiny, tmp_path, family, "flat", _flat)
    nested = _copy(make_tiny, tmp_path, family, "nested", _nested)
    assert "rope_theta" not in json.loads((nested / "config.json").read_text())
    assert _logits(nested) == _logits(flat)


@pytest.mark.parametrize("family, edit, kind", [
    ("gemma2", lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}),
     "linear"),
    ("gemma2", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 8.0}), "linear"),
    ("phi3", lambda c: c.update(rope_scaling={"type": "dynamic", "long_factor": [1.0], "factor": 2.0}), "dynamic"),
    ("gemma3_text", lambda c: c.update(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4}}), "linear"),
])
def test_a_rope_scaling_the_family_s_mlx_lm_model_would_drop_is_one_sentence(make_tiny, tmp_path, family, edit, kind):
    folder = _copy(make_tiny, tmp_path, family, "scaled", edit)
    with pytest.raises(SpillError) as err:
        Streamer(folder)
    assert str(err.value).startswith(f"model folder {folder}: config.json asks for {kind} RoPE scaling")
    assert str(err.value).endswith(f"mlx-lm's {family} model would run without it, with wrong positions; "
                                   "remove the scaling from config.json if the model was trained without it, "
                                   "or use a model or mlx-lm release that supports it")


def test_spill_check_s_reference_reads_the_same_settings(make_tiny, tmp_path):
    """mlx-lm's own loader would drop them too: the resident side of `spill check` gets them as the streamer does."""
    from spill.streamer.check import run_check
    report = run_check(_copy(make_tiny, tmp_path, "llama", "nested", _nested), n=2, max_tokens=3, prefill_chunk=16,
                       dtype="float32")
    assert report.passed and report.identical == 2
