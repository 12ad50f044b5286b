"""llama, mistral and qwen2: embedding, causal masks (sliding where a layer asks), norm, head."""

from .base import Adapter


class LlamaAdapter(Adapter):
    def masks(self, h, caches):
        n = h.shape[1]
        full = caches[0].make_mask(n)
        window = getattr(self.inner, "sliding_window", None)
        if not any(getattr(layer, "use_sliding", False) for layer in self.layers):
            return [full] * len(self.layers)
        slide = caches[0].make_mask(n, window_size=window)
        return [slide if getattr(layer, "use_sliding", False) else full for layer in self.layers]
