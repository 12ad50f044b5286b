"""Family adapters: what surrounds mlx-lm's layers for each model_type.

Adding a family is one small file: subclass `Adapter`, override what differs (embedding scale,
masks, head soft-capping), and list it in FAMILIES once `spill check` passes on it.
"""

from spill.errors import SpillError

from .base import Adapter
from .classify import Verdict, classify
from .gemma import Gemma2Adapter, Gemma3TextAdapter
from .llama import LlamaAdapter

# model_type -> adapter class, for the families whose streamed-vs-resident identity passes.
FAMILIES: dict[str, type[Adapter]] = {
    "llama": LlamaAdapter,
    "mistral": LlamaAdapter,
    "qwen2": Adapter,
    "qwen3": Adapter,
    "phi3": Adapter,
    "gemma2": Gemma2Adapter,
    "gemma3_text": Gemma3TextAdapter,
}
VERIFIED = frozenset(FAMILIES)


def verdict(config: dict) -> Verdict:
    """verified, expected (runs after a warning) or not_yet (with the sentence saying why)."""
    return classify(config, VERIFIED)


def adapter_for(plan) -> Adapter:
    """The family's adapter, after checking that the plan's tensors are exactly the model's."""
    v = verdict(plan.config)
    if not v.runs:
        raise SpillError(f"model folder {plan.folder}: {v.why}")
    adapter = FAMILIES.get(v.model_type, LlamaAdapter)(plan.config)
    adapter.check_names(plan)
    return adapter
