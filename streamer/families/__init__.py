"""Family adapters: what surrounds mlx-lm's layers for each model_type.

Adding a family is one small file: subclass `Adapter`, override what differs (embedding scale,
masks, head soft-capping), and list it in FAMILIES.
"""

from spill.errors import SpillError

from .base import Adapter
from .llama import LlamaAdapter

# model_type -> (adapter class, status). "verified": streamed-vs-resident identity passes.
FAMILIES: dict[str, tuple[type[Adapter], str]] = {
    "llama": (LlamaAdapter, "verified"),
    "mistral": (LlamaAdapter, "verified"),
    "qwen2": (Adapter, "verified"),
}


def adapter_for(plan) -> Adapter:
    """The family's adapter, after checking that the plan's tensors are exactly the model's."""
    config = plan.config
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise SpillError(f"model_type {model_type!r} is not supported yet; supported families: {known}")
    adapter = FAMILIES[model_type][0](config)
    adapter.check_names(plan)
    return adapter
