"""mlx-lm's model classes and quantization guess without its package __init__: the same answers as mlx_lm.utils,
and a streamer process that never imports transformers."""

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import utils

from spill.streamer.families import mlx_lm_parts
from spill.streamer.families.mlx_lm_parts import get_classes, infer_quant_config


def _compiled() -> dict:
    """mlx_lm_parts' names as compiled from mlx_lm/utils.py's source (this process imported mlx_lm.utils)."""
    saved = sys.modules.pop("mlx_lm.utils")
    try:
        mlx_lm_parts._utils.cache_clear()
        return mlx_lm_parts._utils()
    finally:
        sys.modules["mlx_lm.utils"] = saved
        mlx_lm_parts._utils.cache_clear()


@pytest.mark.parametrize("config", [
    {"model_type": "llama"}, {"model_type": "mistral"}, {"model_type": "gemma3_text"}, {"model_type": "qwen3"},
    {"model_type": "bailing_hybrid", "architectures": ["BailingMoeV3ForCausalLM"]}])
def test_the_classes_are_mlx_lms_own(config):
    assert _compiled()["_get_classes"] is not utils._get_classes
    assert _compiled()["_get_classes"](config) == utils._get_classes(config) == get_classes(config)


def test_an_unknown_model_type_is_mlx_lms_own_error():
    with pytest.raises(ValueError, match="Model type no_such_model not supported"):
        _compiled()["_get_classes"]({"model_type": "no_such_model"})


def test_the_quantization_guess_is_mlx_lms_own():
    linear = nn.Linear(128, 64)
    q = nn.QuantizedLinear.from_linear(linear, group_size=32, bits=4)
    weights = {"w.weight": q.weight, "w.scales": q.scales}
    assert _compiled()["infer_quant_config"]("w", linear, weights) == utils.infer_quant_config("w", linear, weights)
    assert infer_quant_config("w", linear, weights) == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert q.scales.dtype != mx.uint8


def test_a_streamer_process_imports_no_transformers(tmp_path):
    """The actor's imports as `python -m` runs it (it stops at once here: no endpoints)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "spill.streamer.process", "{}"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "SPILL_HOME": str(tmp_path)})
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "mlx_lm.sample_utils" in imported and "spill.streamer.core" in imported, out.stderr[-2000:]
    assert not imported & {"transformers", "huggingface_hub", "mlx_lm.utils"}


def test_without_init_mlx_lms_models_load_and_its_own_names_still_run_its_init():
    code = ("import sys; from spill.streamer.families.mlx_lm_parts import get_classes, without_init; without_init()\n"
            "get_classes({'model_type': 'llama'}); import mlx_lm.models.cache\n"
            "print(sorted(m for m in ('transformers', 'huggingface_hub', 'mlx_lm.utils') if m in sys.modules))\n"
            "import mlx_lm; print(mlx_lm.load.__module__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "mlx_lm.utils True"]
