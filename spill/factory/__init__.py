"""Random-weight models of real shapes in Hugging Face layout, for tests, benchmarks and the demo.

    make_model(Path("/tmp/m"), family="qwen2", size="tiny", shard_size="1MB")

    /tmp/m/config.json                      family's real keys, preset shapes
           generation_config.json           bos/eos ids
           tokenizer.json                   byte-level BPE trained locally (cached)
           tokenizer_config.json            chat template, special tokens
           model-00001-of-00003.safetensors random weights, layer by layer
           ...
           model.safetensors.index.json     weight_map (only when sharded)
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any

from spill.errors import SpillError
from spill.factory.families import FAMILIES, Family, get_family, get_shape, model_config, tensor_shapes
from spill.factory.presets import SIZES, Shape
from spill.factory.safetensors_writer import parse_size, write_model
from spill.factory.tokenizer import load_or_train, tokenizer_config
from spill.factory.weights import DTYPES, tensor_blocks
from spill.files import check_new_folder, new_folder

__all__ = ["make_model", "FAMILIES", "SIZES"]


def make_model(out: Path, *, family: str, size: str = "tiny", seed: int = 0,
               dtype: str = "bfloat16", shard_size: str | int | None = None,
               tie_word_embeddings: bool | None = None, bits: int | None = None,
               group_size: int = 64) -> Path:
    """Write a Hugging Face-layout model folder with random weights; return its path.

    family: llama, qwen2 or mistral. size: a preset of `presets.SIZES` (the 1b and 3b
    presets have real Llama-3.2 layer shapes but a 32768-token vocabulary, because the
    tokenizer is trained locally). The same seed gives the same bytes; shard_size
    ("500MB", "2GB" or bytes) splits the weights without changing any tensor.
    tie_word_embeddings: None follows the family's real checkpoints at that size.
    bits (4 or 8) and group_size (32, 64 or 128): MLX-quantized weights in the mlx-community
    layout, written by mlx-lm's own `convert` from the float model (its sharding, not shard_size).
    The folder appears complete or not at all: it is written beside `out` and renamed.
    """
    # 1. check every input before touching the disk
    fam, shape = get_family(family), get_shape(size)
    if dtype not in DTYPES:
        raise SpillError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    if seed < 0:
        raise SpillError(f"seed must be 0 or more, got {seed}; pass a non-negative seed")
    if bits is not None and (bits not in (4, 8) or group_size not in (32, 64, 128)):
        raise SpillError(f"cannot quantize to {bits} bits in groups of {group_size}; "
                         "choose 4 or 8 bits and a group size of 32, 64 or 128")
    max_bytes = None if shard_size is None else parse_size(shard_size)
    out = check_new_folder(out)
    tied = size in fam.tied_sizes if tie_word_embeddings is None else tie_word_embeddings

    # 2. write into a hidden sibling folder, then rename it into place
    with new_folder(out) as tmp:
        _write(tmp, fam, shape, seed=seed, dtype=dtype, tied=tied, max_bytes=max_bytes)
        if bits is not None:
            os.rename(_quantized(tmp, bits, group_size), tmp)   # _quantized removed tmp
    return out.resolve()


def _write(folder: Path, fam: Family, shape: Shape, *, seed: int, dtype: str, tied: bool,
           max_bytes: int | None) -> None:
    # tokenizer first: the config's bos/eos ids come from it
    tok = load_or_train(fam.tokens, shape.vocab)
    tok.save(str(folder / "tokenizer.json"))
    ids = tok.token_to_id
    config = model_config(fam, shape, tied=tied, dtype=dtype, ids=ids)
    _write_json(folder / "config.json", config)
    _write_json(folder / "tokenizer_config.json",
                tokenizer_config(fam.tokens, config["max_position_embeddings"]))
    eos = [ids(t) for t in fam.tokens.generation_eos]
    generation: dict[str, Any] = {"bos_token_id": ids(fam.tokens.config_bos),
                                  "eos_token_id": eos[0] if len(eos) == 1 else eos}
    if fam.tokens.pad is not None:
        generation["pad_token_id"] = ids(fam.tokens.pad)
    _write_json(folder / "generation_config.json", generation)

    tag, itemsize = DTYPES[dtype]
    write_model(folder, tensor_shapes(fam, shape, tied), tag, itemsize,
                lambda name, dims: tensor_blocks(name, dims, seed=seed, dtype=dtype,
                                                 norm_init=fam.norm_init,
                                                 scaled_embedding=fam.scaled_embedding),
                max_bytes)


def _quantized(folder: Path, bits: int, group_size: int) -> Path:
    """mlx-lm's convert of `folder` into a quantized sibling; the float folder is removed."""
    import contextlib
    import io

    from mlx_lm.convert import convert
    out = folder.with_name(folder.name + f"-q{bits}")
    shutil.rmtree(out, ignore_errors=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()):   # convert prints progress lines
            convert(str(folder), str(out), quantize=True, q_bits=bits, q_group_size=group_size)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    (out / "README.md").unlink(missing_ok=True)   # convert's model card names a Hub upload
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
