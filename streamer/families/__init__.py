"""Family adapters: what surrounds mlx-lm's layers for each model_type.

Adding a family is one small file: subclass `Adapter`, override what differs (embedding scale,
masks, head soft-capping), and list it in FAMILIES once `spill check` passes on it.
"""

import importlib

from spill.errors import SpillError

from .classify import Verdict, classify

# model_type -> (module, adapter class), for the families whose streamed-vs-resident identity passes;
# imported on use, so classifying a config (the client does it) loads no MLX.
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaAdapter"),
    "mistral": ("llama", "LlamaAdapter"),
    "qwen2": ("base", "Adapter"),
    "qwen3": ("base", "Adapter"),
    "phi3": ("base", "Adapter"),
    "gemma2": ("gemma", "Gemma2Adapter"),
    "gemma3_text": ("gemma", "Gemma3TextAdapter"),
}
VERIFIED = frozenset(FAMILIES)


def verdict(config: dict) -> Verdict:
    """verified, expected (runs after a warning) or not_yet (with the sentence saying why)."""
    return classify(config, VERIFIED)


def adapter_for(plan):
    """The family's adapter, after checking that the plan's tensors are exactly the model's."""
    v = verdict(plan.config)
    if not v.runs:
        raise SpillError(f"model folder {plan.folder}: {v.why}")
    module, name = FAMILIES.get(v.model_type, ("llama", "LlamaAdapter"))
    from .rope import rope_config   # imported on use: it loads mlx-lm
    adapter = getattr(importlib.import_module(f".{module}", __name__), name)(rope_config(plan.config, plan.folder))
    adapter.check_names(plan)
    return adapter
