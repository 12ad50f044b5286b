"""Architecture classes from config.json alone, with the sentence each refusal prints."""

import json
from pathlib import Path

import pytest

from spill.streamer.families import VERIFIED, verdict
from spill.streamer.families.classify import EXPECTED, NOT_YET

CONFIGS = Path(__file__).parents[2] / "data" / "configs"


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("name, why", [
    ("mixtral", "mixtral is a mixture-of-experts model (num_local_experts = 8 in config.json): per-token "
                "expert routing defeats layer-order streaming; use a dense model"),
    ("deepseek_v3", "deepseek_v3 is a mixture-of-experts model (n_routed_experts = 256 in config.json): "
                    "per-token expert routing defeats layer-order streaming; use a dense model"),
    ("dbrx", "dbrx is a mixture-of-experts model (moe_num_experts = 16 in config.json): per-token expert "
             "routing defeats layer-order streaming; use a dense model"),
    ("qwen2_vl", "qwen2_vl has a vision tower (vision_config in config.json) and spill runs text-only "
                 "decoders; use a text-only variant of the model"),
    ("mamba", "mamba is a state-space or hybrid recurrent model: it has no KV cache to batch rows around, "
              "so spill cannot stream it; use a transformer model"),
    ("jamba", "jamba is a state-space or hybrid recurrent model: it has no KV cache to batch rows around, "
              "so spill cannot stream it; use a transformer model"),
    ("unknown", "model_type 'frobnicator' is unknown to spill and to mlx-lm; spill runs "
                f"{', '.join(sorted(VERIFIED))} (verified) and the other families mlx-lm supports"),
    ("no_model_type", "config.json has no model_type, so spill cannot tell which architecture this is; "
                      "use the model's original config.json"),
])
def test_not_yet_classes_say_why_in_one_sentence(name, why):
    v = verdict(_config(name))
    assert (v.status, v.why, v.runs) == (NOT_YET, why, False)


def test_a_family_mlx_lm_supports_is_expected_with_a_warning():
    v = verdict(_config("olmo2"))
    assert (v.status, v.runs) == (EXPECTED, True)
    assert v.why == ("olmo2 is a family mlx-lm supports but spill has not verified: it should run; "
                     "`spill check MODEL` compares it with mlx-lm")


def test_verified_families_from_the_factory_and_real_configs(make_tiny):
    for family in ("llama", "qwen2", "mistral"):
        config = json.loads((make_tiny(family) / "config.json").read_text())
        assert verdict(config).status == "verified"
    qwen25 = json.loads((CONFIGS.parent / "qwen2.5" / "config.json").read_text())   # a real config
    assert verdict(qwen25).status == "verified"
