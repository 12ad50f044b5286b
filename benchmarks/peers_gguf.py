"""A factory llama folder (safetensors, bf16 or f32) as one GGUF file for llama.cpp, with the `gguf` package.

    python benchmarks/peers_gguf.py MODEL_FOLDER OUT.gguf

The weights keep their stored dtype (BF16 or F32) bit for bit; 1-D tensors (norms) become F32 as llama.cpp
expects. q/k rows are reordered from Hugging Face's rotate-half layout to GGUF's interleaved one, and
llama3 rope scaling becomes the `rope_freqs` tensor, so llama.cpp computes the same function.
The vocabulary is the folder's byte-level BPE (tokens and merges); the benchmark feeds token ids.
llama.cpp's own converter refuses this tokenizer (its pre-tokenizer hash is not in its list).
"""

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

NAMES = {  # Hugging Face name (after "model.layers.N.") -> GGUF name (after "blk.N.")
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
RESIDENT = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    if name in RESIDENT:
        return RESIDENT[name]
    _, _, layer, rest = name.split(".", 3)   # model.layers.N.rest
    return f"blk.{layer}.{NAMES[rest]}"


def interleave_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from [first halves..., second halves...] to pairs (x0, x_half, x1, ...)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config: dict) -> np.ndarray | None:
    """The per-frequency divisors llama3 scaling applies, as llama.cpp reads them from rope_freqs."""
    rs = config.get("rope_scaling") or {}
    if rs.get("rope_type") != "llama3":
        return None
    dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    freqs = 1.0 / float(config.get("rope_theta", 10000.0)) ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    old, lo, hi = rs["original_max_position_embeddings"], rs["low_freq_factor"], rs["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(rs["factor"])
        else:   # the band between: a smooth blend of the two
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / rs["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def add_vocab(writer, folder: Path, config: dict) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok.get("added_tokens", [])}}
    size = int(config["vocab_size"])
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size   # unused until named below
    special = {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    for text, i in vocab.items():
        if i < size:
            tokens[i], types[i] = text, 3 if i in special else 1   # 3: control, 1: normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")   # llama.cpp's name for the factory's split (Llama 3's)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = config.get("eos_token_id")
    writer.add_bos_token_id(int(config["bos_token_id"]))
    writer.add_eos_token_id(int(eos[0] if isinstance(eos, list) else eos))
    writer.add_add_bos_token(False)


def convert(folder: Path, out: Path) -> Path:
    import gguf
    from spill.streamer.plan import load_plan
    plan = load_plan(folder)
    c = plan.config
    if c.get("model_type") != "llama":
        raise SystemExit(f"{folder}: only llama folders convert here (found {c.get('model_type')})")
    heads, kv_heads = int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(folder.name)
    w.add_context_length(int(c["max_position_embeddings"]))
    w.add_embedding_length(int(c["hidden_size"]))
    w.add_block_count(int(c["num_hidden_layers"]))
    w.add_feed_forward_length(int(c["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(c["rms_norm_eps"]))
    w.add_vocab_size(int(c["vocab_size"]))
    f32 = all(t.dtype == "F32" for layer in plan.layers for t in layer)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if f32 else gguf.LlamaFileType.MOSTLY_BF16)
    add_vocab(w, folder, c)
    factors = llama3_rope_factors(c)
    if factors is not None:
        w.add_tensor("rope_freqs.weight", factors)
    maps = {}
    for t in plan.resident + [t for layer in plan.layers for t in layer]:
        if t.dtype not in ("BF16", "F32"):
            raise SystemExit(f"{t.name} is {t.dtype}; this converter takes bfloat16 or float32 folders")
        mm = maps.setdefault(t.path, np.memmap(t.path, dtype=np.uint8, mode="r"))
        raw = mm[t.offset:t.offset + t.nbytes].view(np.uint16 if t.dtype == "BF16" else np.float32).reshape(t.shape)
        if t.name.endswith("q_proj.weight"):
            raw = interleave_rope(raw, heads)
        elif t.name.endswith("k_proj.weight"):
            raw = interleave_rope(raw, kv_heads)
        if t.dtype == "F32":
            w.add_tensor(gguf_name(t.name), np.ascontiguousarray(raw))
        elif raw.ndim == 1:   # norms: F32, the bf16 bits shifted into the high half
            w.add_tensor(gguf_name(t.name), (raw.astype(np.uint32) << 16).view(np.float32))
        else:
            w.add_tensor(gguf_name(t.name), raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fd = os.open(tmp, os.O_RDONLY)   # written pages to disk: a dirty page cannot be dropped from the cache
    os.fsync(fd)
    os.close(fd)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
