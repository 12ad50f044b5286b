"""The family table: each supported family's weight names, config keys and tokens.

Adding a family is one `Family(...)` entry: its per-layer tensor names and shapes as
mlx-lm's model file names them (loaded with strict=True, so they must match exactly),
the fixed keys of its real config.json, and its tokenizer's special tokens. Shapes are
written with the named dimensions of `Shape.dims()`, e.g. ("q", "hidden") is a
[heads*head_dim, hidden] matrix. For example, qwen3 would add
("self_attn.q_norm.weight", ("head_dim",)); phi3 would use ("qkv", "hidden") for
"self_attn.qkv_proj.weight"; gemma2 stores norms as weight-1, so norm_init=0.0.
"""

from dataclasses import dataclass
from typing import Any, Callable

from spill.errors import SpillError
from spill.factory import chat_templates
from spill.factory.presets import SIZES, Shape

Layer = tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class Tokens:
    """A family's special tokens, where they sit in the vocabulary, and its chat format."""

    style: str                      # names the cached tokenizer: llama3, chatml, mistral
    specials: tuple[str, ...]       # in the family's real id order
    specials_first: bool            # True: ids 0.. (mistral); False: after the BPE merges
    filler: str                     # reserved-token pattern that pads the vocab to its exact size
    bos: str | None                 # tokenizer bos_token (None: the tokenizer adds none)
    eos: str                        # tokenizer eos_token: the end of an assistant turn
    config_bos: str
    config_eos: tuple[str, ...]     # config.json eos_token_id (one id, or a list)
    generation_eos: tuple[str, ...]  # generation_config.json eos_token_id
    pad: str | None
    unk: str | None
    chat_template: str


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str
    architecture: str
    layer: Layer                     # tensors of one decoder layer, in file order
    config: dict[str, Any]           # fixed config.json keys; a callable value gets the Shape
    tokens: Tokens
    tied_sizes: frozenset[str]       # presets whose real checkpoints tie lm_head to the embedding
    head_dim_key: bool = False       # write head_dim into config.json
    norm_init: float = 1.0           # value norms are drawn around
    scaled_embedding: bool = False   # the model multiplies the embedding by sqrt(hidden)


LLAMA_LAYER: Layer = (
    ("input_layernorm.weight", ("hidden",)),
    ("self_attn.q_proj.weight", ("q", "hidden")),
    ("self_attn.k_proj.weight", ("kv", "hidden")),
    ("self_attn.v_proj.weight", ("kv", "hidden")),
    ("self_attn.o_proj.weight", ("hidden", "q")),
    ("post_attention_layernorm.weight", ("hidden",)),
    ("mlp.gate_proj.weight", ("ffn", "hidden")),
    ("mlp.up_proj.weight", ("ffn", "hidden")),
    ("mlp.down_proj.weight", ("hidden", "ffn")),
)

# Qwen2 adds biases to q, k and v (not o).
QWEN2_LAYER: Layer = (
    ("input_layernorm.weight", ("hidden",)),
    ("self_attn.q_proj.weight", ("q", "hidden")),
    ("self_attn.q_proj.bias", ("q",)),
    ("self_attn.k_proj.weight", ("kv", "hidden")),
    ("self_attn.k_proj.bias", ("kv",)),
    ("self_attn.v_proj.weight", ("kv", "hidden")),
    ("self_attn.v_proj.bias", ("kv",)),
    ("self_attn.o_proj.weight", ("hidden", "q")),
    ("post_attention_layernorm.weight", ("hidden",)),
    ("mlp.gate_proj.weight", ("ffn", "hidden")),
    ("mlp.up_proj.weight", ("ffn", "hidden")),
    ("mlp.down_proj.weight", ("hidden", "ffn")),
)

# Qwen3: llama's layer plus RMSNorms over each head's queries and keys.
QWEN3_LAYER: Layer = LLAMA_LAYER[:5] + (
    ("self_attn.q_norm.weight", ("head_dim",)),
    ("self_attn.k_norm.weight", ("head_dim",)),
) + LLAMA_LAYER[5:]

# Phi-3: fused q/k/v and fused gate/up projections.
PHI3_LAYER: Layer = (
    ("input_layernorm.weight", ("hidden",)),
    ("self_attn.qkv_proj.weight", ("qkv", "hidden")),
    ("self_attn.o_proj.weight", ("hidden", "q")),
    ("post_attention_layernorm.weight", ("hidden",)),
    ("mlp.gate_up_proj.weight", ("ffn2", "hidden")),
    ("mlp.down_proj.weight", ("hidden", "ffn")),
)

# Gemma 2: norms before and after both attention and the MLP (stored as weight - 1).
GEMMA2_LAYER: Layer = LLAMA_LAYER[:6] + (("pre_feedforward_layernorm.weight", ("hidden",)),) + \
    LLAMA_LAYER[6:] + (("post_feedforward_layernorm.weight", ("hidden",)),)

# Gemma 3: Gemma 2's layer plus per-head query and key norms.
GEMMA3_LAYER: Layer = GEMMA2_LAYER[:5] + (
    ("self_attn.q_norm.weight", ("head_dim",)),
    ("self_attn.k_norm.weight", ("head_dim",)),
) + GEMMA2_LAYER[5:]

LLAMA3_TOKENS = Tokens(
    style="llama3",
    specials=("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
              "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
              "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
              "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"),
    specials_first=False, filler="<|reserved_special_token_{}|>",
    bos="<|begin_of_text|>", eos="<|eot_id|>", config_bos="<|begin_of_text|>",
    config_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
    generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
    pad="<|finetune_right_pad_id|>", unk=None, chat_template=chat_templates.LLAMA3,
)

CHATML_TOKENS = Tokens(
    style="chatml", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    specials_first=False, filler="<|extra_{}|>",
    bos=None, eos="<|im_end|>", config_bos="<|endoftext|>", config_eos=("<|im_end|>",),
    generation_eos=("<|im_end|>", "<|endoftext|>"),
    pad="<|endoftext|>", unk=None, chat_template=chat_templates.CHATML,
)

MISTRAL_TOKENS = Tokens(
    style="mistral",
    specials=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
              "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
    specials_first=True, filler="[control_{}]",
    bos="<s>", eos="</s>", config_bos="<s>", config_eos=("</s>",), generation_eos=("</s>",),
    pad=None, unk="<unk>", chat_template=chat_templates.MISTRAL,
)

PHI3_TOKENS = Tokens(
    style="phi3",
    specials=("<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|placeholder1|>",
              "<|placeholder2|>", "<|placeholder3|>", "<|placeholder4|>", "<|system|>", "<|end|>",
              "<|placeholder5|>", "<|placeholder6|>", "<|user|>"),
    specials_first=True, filler="<|placeholder_{}|>",
    bos="<s>", eos="<|endoftext|>", config_bos="<s>", config_eos=("<|endoftext|>",),
    generation_eos=("<|endoftext|>", "<|assistant|>", "<|end|>"),
    pad="<|endoftext|>", unk="<unk>", chat_template=chat_templates.PHI3,
)

GEMMA_TOKENS = Tokens(
    style="gemma",
    specials=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
    specials_first=True, filler="<unused{}>",
    bos="<bos>", eos="<eos>", config_bos="<bos>", config_eos=("<eos>", "<end_of_turn>"),
    generation_eos=("<eos>", "<end_of_turn>"),
    pad="<pad>", unk="<unk>", chat_template=chat_templates.GEMMA,
)

FAMILIES: dict[str, Family] = {
    # Llama-3.2 style: llama3 rope scaling, head_dim in the config, tied at 1B/3B
    "llama": Family(
        name="llama", model_type="llama", architecture="LlamaForCausalLM",
        layer=LLAMA_LAYER, tokens=LLAMA3_TOKENS, tied_sizes=frozenset({"1b", "3b", "deep"}),
        head_dim_key=True,
        config={
            "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 131072, "mlp_bias": False,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "use_cache": True,
        },
    ),
    # Qwen2.5 style: q/k/v biases, tied embeddings up to 3B, head_dim = hidden / heads
    "qwen2": Family(
        name="qwen2", model_type="qwen2", architecture="Qwen2ForCausalLM",
        layer=QWEN2_LAYER, tokens=CHATML_TOKENS, tied_sizes=frozenset(SIZES),
        config={
            "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 32768, "max_window_layers": lambda s: s.layers,
            "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
            "sliding_window": 32768, "use_cache": True, "use_sliding_window": False,
        },
    ),
    # Mistral-7B-v0.3 style: untied lm_head, no sliding window; mlx-lm loads it as llama
    "mistral": Family(
        name="mistral", model_type="mistral", architecture="MistralForCausalLM",
        layer=LLAMA_LAYER, tokens=MISTRAL_TOKENS, tied_sizes=frozenset(),
        config={
            "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
            "sliding_window": None, "use_cache": True,
        },
    ),
    # Qwen3-0.6B style: q/k norms, head_dim in the config, tied embeddings up to 4B
    "qwen3": Family(
        name="qwen3", model_type="qwen3", architecture="Qwen3ForCausalLM",
        layer=QWEN3_LAYER, tokens=CHATML_TOKENS, tied_sizes=frozenset(SIZES), head_dim_key=True,
        config={
            "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 40960,
            "max_window_layers": lambda s: s.layers, "rms_norm_eps": 1e-06, "rope_scaling": None,
            "rope_theta": 1000000.0, "sliding_window": None, "use_cache": True,
            "use_sliding_window": False,
        },
    ),
    # Phi-3-mini-4k style: fused projections, untied head, head_dim = hidden / heads
    "phi3": Family(
        name="phi3", model_type="phi3", architecture="Phi3ForCausalLM",
        layer=PHI3_LAYER, tokens=PHI3_TOKENS, tied_sizes=frozenset(),
        config={
            "attention_bias": False, "attention_dropout": 0.0, "embd_pdrop": 0.0, "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
            "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "use_cache": True,
        },
    ),
    # Gemma-2-2b style: embedding scale, +1 norms, attention and final-logit soft-capping, tied
    "gemma2": Family(
        name="gemma2", model_type="gemma2", architecture="Gemma2ForCausalLM",
        layer=GEMMA2_LAYER, tokens=GEMMA_TOKENS, tied_sizes=frozenset(SIZES), head_dim_key=True,
        norm_init=0.0, scaled_embedding=True,
        config={
            "attention_bias": False, "attention_dropout": 0.0, "attn_logit_softcapping": 50.0,
            "cache_implementation": "hybrid", "final_logit_softcapping": 30.0,
            "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
            "initializer_range": 0.02, "max_position_embeddings": 8192,
            "query_pre_attn_scalar": lambda s: s.head_dim, "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0, "sliding_window": 4096, "use_cache": True,
        },
    ),
    # Gemma-3-1b style: q/k norms, local layers with a sliding window (one global layer in 6);
    # small presets get a 32-token window and every 2nd layer global, so tests cross both
    "gemma3_text": Family(
        name="gemma3_text", model_type="gemma3_text", architecture="Gemma3ForCausalLM",
        layer=GEMMA3_LAYER, tokens=GEMMA_TOKENS, tied_sizes=frozenset(SIZES), head_dim_key=True,
        norm_init=0.0, scaled_embedding=True,
        config={
            "attention_bias": False, "attention_dropout": 0.0, "attn_logit_softcapping": None,
            "final_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
            "initializer_range": 0.02, "max_position_embeddings": 32768,
            "query_pre_attn_scalar": lambda s: s.head_dim, "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
            "sliding_window": lambda s: 512 if s.layers >= 12 else 32,
            "sliding_window_pattern": lambda s: 6 if s.layers >= 12 else 2, "use_cache": True,
        },
    ),
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise SpillError(f"unknown model family {name!r}; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def get_shape(size: str) -> Shape:
    if size not in SIZES:
        raise SpillError(f"unknown size preset {size!r}; choose one of: {', '.join(SIZES)}")
    return SIZES[size]


def tensor_shapes(family: Family, shape: Shape, tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight in file order: embedding, layers 0..N-1 (each contiguous), norm, lm_head."""
    dims = shape.dims()
    out = [("model.embed_tokens.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        out += [(f"model.layers.{i}.{name}", tuple(dims[d] for d in ds)) for name, ds in family.layer]
    out.append(("model.norm.weight", (shape.hidden,)))
    if not tied:
        out.append(("lm_head.weight", (shape.vocab, shape.hidden)))
    return out


def model_config(family: Family, shape: Shape, *, tied: bool, dtype: str,
                 ids: Callable[[str], int]) -> dict[str, Any]:
    """config.json, keys sorted as transformers writes them; `ids` maps a token to its id."""
    if not family.head_dim_key and shape.head_dim * shape.heads != shape.hidden:
        raise ValueError(f"{family.name} derives head_dim from hidden/heads; the preset disagrees")
    eos = [ids(t) for t in family.tokens.config_eos]
    cfg: dict[str, Any] = {
        "architectures": [family.architecture], "model_type": family.model_type,
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
        "tie_word_embeddings": tied, "torch_dtype": dtype,
        "bos_token_id": ids(family.tokens.config_bos),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }
    if family.head_dim_key:
        cfg["head_dim"] = shape.head_dim
    for key, value in family.config.items():
        cfg[key] = value(shape) if callable(value) else value
    return dict(sorted(cfg.items()))
