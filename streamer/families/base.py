"""What every family adapter does: wrap an mlx-lm model built lazily, run its pieces one at a time.

mlx-lm's `Model.__call__` runs every layer for one batch; the streamer inverts that loop, so an
adapter exposes the parts around the layers (embedding, masks, final norm, head) and the layers.
"""

import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import BatchKVCache

from spill.errors import SpillError
from spill.platform import activation_streams, chunk_attention

from ..attention import pooled_attention
from ..streams import cpu_streams, spread
from ..plan import ModelPlan, layer_of, layer_prefix
from .mlx_lm_parts import get_classes, infer_quant_config


# safetensors codes of packed and scale tensors -> the dtype their stubs need for mlx-lm's checks
_STUB = {"U32": mx.uint32, "U8": mx.uint8, "BF16": mx.bfloat16, "F16": mx.float16}
# mlx-lm modules whose MLP is down_proj(swiglu(gate, up)): gate and up from their own products, or one split in two
_SWIGLU = {"llama": "gate_proj", "qwen2": "gate_proj", "qwen3": "gate_proj", "phi3": "gate_up_proj"}
SPLIT_ROWS = 8   # rows of a SwiGLU each CPU stream takes at least


class Adapter:
    """Llama-shaped models: `model.embed_tokens`, `model.layers`, `model.norm`, `lm_head` or tied."""

    fused_mlp = True   # its blocks are h = x + attn(norm(x)), h + mlp(norm(h)): one MLP product for every group

    def __init__(self, config: dict):
        model_class, args_class = get_classes(config)
        self.config = config
        self.args = args_class.from_dict(config)
        # Parameters stay lazy (never evaluated) until real weights replace them.
        self.model = model_class(self.args)
        self.inner = self.model.model
        self.layers = list(self.inner.layers)
        self._blank = [layer.parameters() for layer in self.layers]
        self.split = activation_streams()   # the SwiGLU and prompts' attention over this many CPU streams
        module = sys.modules[model_class.__module__]   # its attention: pool by pool over several decode pools
        sdpa = getattr(module, "scaled_dot_product_attention", None)
        if sdpa is not None and not getattr(sdpa, "pooled", False):
            sdpa = module.scaled_dot_product_attention = pooled_attention(sdpa)
        if sdpa is not None:
            sdpa.split = self.split   # the module's, as the adapter made last found it
            sdpa.ops = chunk_attention() == "ops"

    @property
    def tied(self) -> bool:
        return bool(getattr(self.args, "tie_word_embeddings", False))

    # -- weights ---------------------------------------------------------------------------
    def check_names(self, plan: ModelPlan) -> None:
        """The files hold exactly the tensors the model has, layer by layer: one sentence if not."""
        # one sanitize over every name, as mlx-lm's loader does (some decide ties from the whole set)
        specs = plan.resident + [s for layer in plan.layers for s in layer]
        stubs = {s.name: mx.zeros(s.shape, _STUB.get(s.dtype, mx.float32)) for s in specs}   # lazy, never evaluated
        names = self.sanitize(stubs)
        if self.config.get("quantization"):
            self._quantize(self.config["quantization"], names)
        by_layer: dict[int | None, set[str]] = {}
        for name in names:
            by_layer.setdefault(layer_of(name), set()).add(name)
        for i in range(len(self.layers)):
            found = by_layer.get(i, set())
            prefix = layer_prefix(next(iter(found))) if found else f"model.layers.{i}."
            self._match(plan, found, {prefix + k for k, _ in tree_flatten(self._blank[i])})
        self._match(plan, by_layer.get(None, set()), self._resident_names())

    def _quantize(self, quantization: dict, stubs: dict) -> None:
        """Quantized layers where the files hold scales, as mlx-lm's loader decides (mlx-community layout)."""
        def predicate(path, module):
            if path in quantization:          # a per-layer setting
                return quantization[path]
            if not hasattr(module, "to_quantized") or f"{path}.scales" not in stubs:
                return False
            return infer_quant_config(path, module, stubs)
        nn.quantize(self.model, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"), class_predicate=predicate)
        self._blank = [layer.parameters() for layer in self.layers]

    def sanitize(self, weights: dict) -> dict:
        """mlx-lm's renames and drops of checkpoint names (families without one keep them as they are)."""
        fn = getattr(self.model, "sanitize", None)
        return fn(weights) if fn is not None else weights

    def _resident_names(self) -> set[str]:
        return {k for k, _ in tree_flatten(self.model.parameters()) if layer_of(k) is None}

    def _match(self, plan: ModelPlan, found: set[str], want: set[str]) -> None:
        kind = plan.config.get("model_type")
        if missing := sorted(want - found):
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise SpillError(f"model folder {plan.folder}: the weights have no tensor {missing[0]}{more}, "
                             f"which a {kind} model needs; the files are incomplete: re-download the model")
        if extra := sorted(found - want):
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise SpillError(f"model folder {plan.folder}: the weights hold tensor {extra[0]}{more}, which a "
                             f"{kind} model does not have; check config.json's model_type or re-download the model")

    def load_resident(self, weights: dict[str, mx.array]) -> None:
        """Embedding, final norm and head (`check_names` has matched them to the model)."""
        weights = self.sanitize(dict(weights))
        self.model.update(tree_unflatten(list(weights.items())))
        mx.eval(list(weights.values()))

    def load_layer(self, i: int, weights: dict[str, mx.array]) -> None:
        weights = self.sanitize(dict(weights))
        first = next(iter(weights))
        if layer_of(first) != i:
            raise ValueError(f"tensor {first} is not in layer {i}")
        prefix = layer_prefix(first)
        local = [(k[len(prefix):], v) for k, v in weights.items()]
        self.layers[i].update(tree_unflatten(local))

    def unload_layer(self, i: int) -> None:
        """Drop the layer's weights (back to the lazy placeholders) so their memory is freed."""
        self.layers[i].update(self._blank[i])

    def run_layer(self, i: int, hs: list[mx.array], masks: list, caches: list) -> list[mx.array]:
        """Every group's input through layer i: attention group by group (its own mask and cache), then
        the MLP once over all their tokens: a separate product through the weights costs a CPU their trip
        through memory again (`benchmarks/prefill_groups.py --unfused`, 2 cores, lean45: one more group ~0.9 s a pass,
        ~0.5 with the MLP shared)."""
        layer = self.layers[i]
        if not self.fused_mlp or (len(hs) == 1 and not self._swiglu(layer.mlp)):
            return [layer(h, m, cache=c) for h, m, c in zip(hs, masks, caches)]
        hs = [h + layer.self_attn(layer.input_layernorm(h), m, c) for h, m, c in zip(hs, masks, caches)]
        if len(hs) == 1:   # the block's own steps, the SwiGLU split
            return [hs[0] + self.mlp(layer.mlp, layer.post_attention_layernorm(hs[0]))]
        flat = mx.concatenate([h.reshape(-1, h.shape[-1]) for h in hs])
        flat = flat + self.mlp(layer.mlp, layer.post_attention_layernorm(flat))
        ends = np.cumsum([h.shape[0] * h.shape[1] for h in hs]).tolist()
        return [flat[a:b].reshape(h.shape) for a, b, h in zip([0, *ends], ends, hs)]

    def _swiglu(self, mlp) -> str | None:
        """Where `mlp`'s SwiGLU can be split here, the product that makes its inputs (_SWIGLU); else None."""
        return _SWIGLU.get(type(mlp).__module__.rsplit(".", 1)[-1]) if self.split > 1 else None

    def mlp(self, mlp, x: mx.array) -> mx.array:
        """mlp(x), its SwiGLU's rows split over the CPU streams where there are enough: the module's own kernel on
        the same values, so bit for bit mlp(x)."""
        rows, form = x.size // x.shape[-1], self._swiglu(mlp)
        streams = cpu_streams(self.split)[:rows // SPLIT_ROWS] if form else []   # a stream every SPLIT_ROWS rows
        if len(streams) < 2:
            return mlp(x)
        if form == "gate_up_proj":
            gate, up = mx.split(mlp.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        swiglu = sys.modules[type(mlp).__module__].swiglu
        gate, up = gate.reshape(rows, -1), up.reshape(rows, -1)
        return mlp.down_proj(spread(streams, rows, lambda a, b: swiglu(gate[a:b], up[a:b])).reshape(*x.shape[:-1], -1))

    # -- the parts around the layers ---------------------------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def make_cache(self, i: int, left_padding: list[int]) -> BatchKVCache:
        return BatchKVCache(left_padding)

    def masks(self, h: mx.array, caches: list) -> list:
        """One mask per layer for a group whose input is `h` [B, T, D] and caches its KV."""
        mask = caches[0].make_mask(h.shape[1])
        return [mask] * len(self.layers)

    def head(self, h: mx.array) -> mx.array:
        """Final norm and head on the hidden states `h` [B, D] -> logits [B, vocab]."""
        h = self.inner.norm(h)
        if self.tied:
            return self.inner.embed_tokens.as_linear(h)
        return self.model.lm_head(h)
