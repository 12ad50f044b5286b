"""Model folders spill did not generate: real tokenizers, chat templates and configs from
tests/data, random weights written by MLX's own safetensors writer (its tensor order, its sharding)."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

DATA = Path(__file__).parent.parent / "data"
SMALL = dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)

# Mistral-7B-v0.3's config keys and settings (vocab 32768, rope_theta 1e6, untied head), narrowed.
MISTRAL = dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=32768, rms_norm_eps=1e-5,
               rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False, sliding_window=None,
               bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", head_dim=32)
# Llama-3.2's rope settings (llama3 scaling, theta 5e5, explicit head_dim, tied head), narrowed.
LLAMA32 = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
               rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
               max_position_embeddings=131072, tie_word_embeddings=True, head_dim=48, torch_dtype="bfloat16")


def build(out: Path, config: dict, tokenizer_from: Path, shards: int, dtype=mx.bfloat16, chat_template_from=None) -> Path:
    """Write config, tokenizer files and random weights in `shards` safetensors files with an index."""
    out.mkdir(parents=True)
    config = {**config, **SMALL}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    if chat_template_from is not None:
        tc = json.loads((out / "tokenizer_config.json").read_text())
        tc["chat_template"] = json.loads(Path(chat_template_from).read_text())["chat_template"]
        (out / "tokenizer_config.json").write_text(json.dumps(tc))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model_class, args_class = _get_classes(config)
    mx.random.seed(1)
    model = model_class(args_class.from_dict(config))
    weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    names = sorted(weights)
    if shards == 1:
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
        return out
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        part = names[s * per:(s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(out / fname), {k: weights[k] for k in part}, metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def mistral_v03(out: Path) -> Path:
    """Mistral's real SentencePiece-style tokenizer and [INST] template; untied head; 2 shards."""
    return build(out, MISTRAL, DATA / "mistral-v0.3", shards=2)


def qwen25(out: Path, generated_tokenizer: Path) -> Path:
    """Qwen2.5's real config (q/k/v biases, tied, theta 1e6) and ChatML template; one file, float32."""
    config = json.loads((DATA / "qwen2.5" / "config.json").read_text())
    config["vocab_size"] = json.loads((generated_tokenizer / "config.json").read_text())["vocab_size"]
    folder = build(out, config, generated_tokenizer, shards=1, dtype=mx.float32,
                   chat_template_from=DATA / "qwen2.5" / "tokenizer_config.json")
    shutil.copy(DATA / "qwen2.5" / "generation_config.json", folder / "generation_config.json")
    return folder


def llama32_with_phi3_tokenizer(out: Path) -> Path:
    """Llama-3.2 rope scaling and tied head, with Phi-3's real tokenizer and template; 3 shards."""
    config = {**LLAMA32, "vocab_size": 32064, "bos_token_id": 1, "eos_token_id": [32000, 32007]}
    return build(out, config, DATA / "phi-3", shards=3)
