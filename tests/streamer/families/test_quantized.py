"""MLX-quantized models (mlx-community layout) stream and match mlx-lm loading the same folder."""

import json

import pytest

from spill.errors import SpillError
from spill.factory import make_model
from spill.streamer.check import run_check


@pytest.mark.parametrize("family, bits, group_size", [
    ("llama", 4, 32), ("qwen3", 8, 64), ("gemma2", 4, 64), ("phi3", 8, 128),
])
def test_quantized_models_pass_the_check(make_tiny, family, bits, group_size):
    folder = make_tiny(family, bits=bits, group_size=group_size)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"] == {"group_size": group_size, "bits": bits, "mode": "affine"}
    report = run_check(folder, n=4, max_tokens=5, prefill_chunk=32)
    rows = report.rows
    assert report.passed and report.max_logit_diff <= 1e-4
    assert [r.got for r in rows] == [r.expected for r in rows]
    assert [r.first_got for r in rows] == [r.first_expected for r in rows]


def test_an_unsupported_quantization_is_one_sentence(tmp_path):
    with pytest.raises(SpillError) as err:
        make_model(tmp_path / "m", family="llama", bits=3)
    assert str(err.value) == ("cannot quantize to 3 bits in groups of 64; choose 4 or 8 bits and a group size "
                              "of 32, 64 or 128")
    assert not (tmp_path / "m").exists()
