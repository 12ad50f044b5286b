"""gemma2 and gemma3_text: embedding scale, +1 norms (mlx-lm's blocks), soft-capping, sliding windows.

gemma2's attention groups query heads as [B, kv_heads, repeats, T, S] when kv_heads < heads, so a
batch mask [B, 1, T, S] would broadcast B against kv_heads (mlx-lm's own batch path breaks there);
spill gives it one more axis, [B, 1, 1, T, S].
"""

import mlx.core as mx
from .base import Adapter


class Gemma2Adapter(Adapter):
    fused_mlp = False   # norms after attention and around the MLP: each group through its own block

    def embed(self, tokens):
        return self.inner.embed_tokens(tokens) * (self.args.hidden_size ** 0.5)

    def masks(self, h, caches):
        mask = caches[0].make_mask(h.shape[1])
        if self.args.num_attention_heads > self.args.num_key_value_heads:
            mask = mx.expand_dims(mask, 2)
        return [mask] * len(self.layers)

    def head(self, h):
        logits = self.inner.embed_tokens.as_linear(self.inner.norm(h))
        cap = self.args.final_logit_softcapping
        return mx.tanh(logits / cap) * cap


class Gemma3TextAdapter(Adapter):
    """Every `sliding_window_pattern`-th layer is global; the others attend to a sliding window: a
    full cache (the decode pool's slots are full width) under a window mask."""

    fused_mlp = False

    def __init__(self, config):
        super().__init__(config)
        self._sanitized = False

    def sanitize(self, weights):
        # mlx-lm's gemma3 sanitize decides the tie from the whole set of names (and drops lm_head): once
        if self._sanitized:
            return weights
        self._sanitized = True
        return super().sanitize(weights)

    def _global(self, i: int) -> bool:
        pattern = self.args.sliding_window_pattern
        return i % pattern == pattern - 1

    def embed(self, tokens):
        h = self.inner.embed_tokens(tokens)
        return h * mx.array(self.args.hidden_size ** 0.5, mx.bfloat16).astype(h.dtype)

    def masks(self, h, caches):
        # every layer's cache of a group has the same offsets and kind: the first one's masks serve them all
        n = h.shape[1]
        full, slide = caches[0].make_mask(n), caches[0].make_mask(n, window_size=self.args.sliding_window)
        return [full if self._global(i) else slide for i in range(len(self.layers))]

    def head(self, h):
        h = self.inner.norm(h)
        if self.model.tie_word_embeddings:
            return self.inner.embed_tokens.as_linear(h)
        return self.model.lm_head(h)
