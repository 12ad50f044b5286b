"""Architecture classes, from config.json alone (no weight is read):

    verified   spill's streamed-vs-resident identity passes for the family     runs
    expected   a family mlx-lm supports that spill has not verified            runs after a warning
    not_yet    mixture-of-experts, a vision/audio tower, state-space or
               hybrid recurrence, an unknown model_type                         one sentence, no run
"""

import importlib.util
from dataclasses import dataclass

VERIFIED, EXPECTED, NOT_YET = "verified", "expected", "not_yet"

# config keys whose value > 1 means per-token expert routing (mixtral, qwen*_moe, deepseek, dbrx, ...)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# families that keep a recurrent state (all or some layers) instead of a KV cache
_RECURRENT = frozenset({
    "mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "rwkv", "rwkv6", "rwkv7",
    "recurrent_gemma", "nemotron_h", "falcon_h1", "granitemoehybrid", "lfm2", "lfm2_moe", "plamo2",
    "qwen3_next", "kimi_linear", "bailing_hybrid", "olmo_hybrid", "ssm",
})
_RECURRENT_KEYS = ("ssm_cfg", "mamba_d_state", "hybrid_override_pattern", "layers_block_type")


@dataclass(frozen=True)
class Verdict:
    status: str          # VERIFIED, EXPECTED or NOT_YET
    model_type: str
    why: str = ""        # the warning (expected) or the refusal (not_yet): one sentence

    @property
    def runs(self) -> bool:
        return self.status != NOT_YET


def classify(config: dict, verified: frozenset[str]) -> Verdict:
    """The class of a model from its config.json; `verified` lists the families spill has verified."""
    kind = config.get("model_type")
    if not isinstance(kind, str) or not kind:
        return Verdict(NOT_YET, "", "config.json has no model_type, so spill cannot tell which architecture "
                                    "this is; use the model's original config.json")
    for tower in ("vision_config", "audio_config"):
        if config.get(tower) is not None:
            what = tower.split("_")[0]
            return Verdict(NOT_YET, kind, f"{kind} has a {what} tower ({tower} in config.json) and spill runs "
                                          "text-only decoders; use a text-only variant of the model")
    for key, value in _experts(config):
        return Verdict(NOT_YET, kind, f"{kind} is a mixture-of-experts model ({key} = {value} in config.json): "
                                      "per-token expert routing defeats layer-order streaming; use a dense model")
    if kind in _RECURRENT or any(k in config for k in _RECURRENT_KEYS):
        return Verdict(NOT_YET, kind, f"{kind} is a state-space or hybrid recurrent model: it has no KV cache "
                                      "to batch rows around, so spill cannot stream it; use a transformer model")
    if kind in verified:
        return Verdict(VERIFIED, kind)
    if _mlx_lm_knows(kind):
        return Verdict(EXPECTED, kind, f"{kind} is a family mlx-lm supports but spill has not verified: it "
                                       "should run; `spill check MODEL` compares it with mlx-lm")
    return Verdict(NOT_YET, kind, f"model_type {kind!r} is unknown to spill and to mlx-lm; spill runs "
                                  f"{', '.join(sorted(verified))} (verified) and the other families mlx-lm supports")


def _experts(config: dict):
    """(key, value) pairs that say the model routes tokens to experts."""
    for source in (config, config.get("ffn_config") or {}):
        for key in _EXPERT_KEYS:
            value = source.get(key) if isinstance(source, dict) else None
            if isinstance(value, int) and value > 1:
                yield key, value


def _mlx_lm_knows(kind: str) -> bool:
    from mlx_lm.utils import MODEL_REMAPPING
    module = MODEL_REMAPPING.get(kind, kind)
    if not module.replace("_", "").isalnum():
        return False
    return importlib.util.find_spec(f"mlx_lm.models.{module}") is not None
