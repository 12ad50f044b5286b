"""The model plan: which bytes of which file are which layer, read from the safetensors headers.

A safetensors file is an 8-byte little-endian header length n, a JSON header of n bytes, then the
tensor data; each header entry gives dtype, shape and data_offsets [start, end) relative to the
data (byte 8 + n). The plan never reads tensor data, only headers:

    model.safetensors          layers[0] = [model.layers.0.input_layernorm.weight, ...]  (file order)
      8 | {"model.embed_...   layers[1] = [...]
          | data ...            resident  = [model.embed_tokens.weight, model.norm.weight, lm_head...]

Every inconsistency is a SpillError of one line naming the file, what was expected, what was found
and what to do.
"""

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from spill.errors import SpillError

# safetensors dtype code -> bytes per element (sub-byte codes such as F4 are not supported).
ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}

# A `layers.<i>.` component: model.layers.12., model.language_model.layers.12.
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_REDOWNLOAD = "the file is corrupt, re-download it"
MAX_HEADER = 100_000_000   # bytes of a safetensors JSON header, at most (the reference implementation's cap)


@dataclass(frozen=True)
class TensorSpec:
    name: str               # as in the file, e.g. "model.layers.3.mlp.up_proj.weight"
    path: Path              # the shard file
    offset: int             # absolute byte offset of the data in that file
    nbytes: int
    dtype: str              # safetensors code: "BF16", "F16", "F32", "I32", "U8", ...
    shape: tuple[int, ...]


@dataclass
class ModelPlan:
    folder: Path
    config: dict                      # config.json
    layers: list[list[TensorSpec]]    # layers[i] = tensors of transformer layer i, in file order
    resident: list[TensorSpec]        # everything not in a layer (embedding, final norm, lm_head, ...)

    def layer_bytes(self, i: int) -> int:
        return sum(t.nbytes for t in self.layers[i])

    @property
    def streamed_bytes(self) -> int:
        return sum(self.layer_bytes(i) for i in range(len(self.layers)))

    @property
    def total_bytes(self) -> int:
        return self.streamed_bytes + sum(t.nbytes for t in self.resident)

    @property
    def kv_heads_and_dim(self) -> tuple[int, int]:
        """(key/value heads, head dim) of a layer's attention, as config.json gives or implies them."""
        c = self.config
        heads = int(c.get("num_attention_heads", 1))
        return int(c.get("num_key_value_heads") or heads), int(c.get("head_dim") or int(c["hidden_size"]) // heads)


def load_plan(folder: str | Path) -> ModelPlan:
    folder = Path(folder)
    config = _read_config(folder)
    shards, index, weight_map = _shards(folder)
    headers = {p: read_header(p) for p in shards}
    if index is not None:
        _check_index(index, weight_map, headers)
    tensors = [t for p in shards for t in headers[p]]
    _check_unique(folder, tensors)
    layers, resident = _split_layers(folder, tensors, config)
    return ModelPlan(folder=folder, config=config, layers=layers, resident=resident)


def layer_of(name: str) -> int | None:
    """The transformer layer a tensor belongs to, or None for a resident tensor."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def layer_prefix(name: str) -> str | None:
    """The part of a layer tensor's name up to its layer number: "model.layers.3."."""
    m = _LAYER.search(name)
    return name[: m.end()] if m else None


# -- the folder ---------------------------------------------------------------------------------
def _read_config(folder: Path) -> dict:
    want = "expected a folder with config.json and *.safetensors"
    if not folder.exists():
        raise SpillError(f"model folder {folder}: {want}, found nothing at that path; check the path")
    if not folder.is_dir():
        raise SpillError(f"model folder {folder}: {want}, found a file; pass the folder that holds it")
    path = folder / "config.json"
    if not path.is_file():
        raise SpillError(f"model folder {folder}: expected config.json, found none; "
                         "copy the model's config.json into the folder")
    try:
        config = json.loads(path.read_text())
    except RecursionError:
        raise SpillError(f"{path}: expected a JSON object, found JSON nested too deeply to read; "
                         "re-download config.json") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise SpillError(f"{path}: expected a JSON object, found invalid JSON ({_one_line(err)}); "
                         "re-download config.json") from None
    if not isinstance(config, dict):
        raise SpillError(f"{path}: expected a JSON object, found {type(config).__name__}; "
                         "re-download config.json")
    return config


def _shards(folder: Path) -> tuple[list[Path], Path | None, dict]:
    """The safetensors files in read order (the index's shards, else every *.safetensors, by name),
    the index file if there is one and its weight map."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise TypeError
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError, RecursionError):
            raise SpillError(f"{index}: expected JSON with a \"weight_map\" of tensor name -> shard file, "
                             "found something else; re-download the index") from None
        names = sorted(set(weight_map.values()))
        for name in names:
            if not _inside(folder, name):
                raise SpillError(f"{index}: names shard {name!r}, expected a file name inside {folder}; "
                                 "the index is not safe to use, re-download it")
            if not (folder / name).is_file():
                raise SpillError(f"{index}: names shard {name}, found no such file in {folder}; "
                                 "download the missing shard")
        return [folder / name for name in names], index, weight_map
    shards = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if not shards:
        raise SpillError(f"model folder {folder}: expected *.safetensors weight files, found none; "
                         "spill reads safetensors only, save the weights with safe_serialization=True")
    return shards, None, {}


def _inside(folder: Path, name: str) -> bool:
    """A shard name that stays in the folder: relative, without '..' (links are the folder owner's choice:
    the Hugging Face cache links every file to its blob)."""
    return bool(name) and "\0" not in name and not Path(name).is_absolute() and ".." not in Path(name).parts


def _check_index(index: Path, weight_map: dict, headers: dict[Path, list[TensorSpec]]) -> None:
    names = {p: {t.name for t in specs} for p, specs in headers.items()}
    for tensor, shard in weight_map.items():
        if tensor not in names[index.parent / shard]:
            raise SpillError(f"{index}: maps {tensor} to {shard}, found no such tensor in that file; "
                             "re-download the model")


# -- one file's header ----------------------------------------------------------------------------
def read_header(path: Path) -> list[TensorSpec]:
    """The tensors of one safetensors file, sorted by offset, each checked against the file."""
    return _parse_header(path, path.stat().st_size)


def _parse_header(path: Path, size: int) -> list[TensorSpec]:
    fd = os.open(path, os.O_RDONLY)
    try:
        head = os.pread(fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or 8 + n > size:
            want = f"a header of {n} bytes after the 8-byte length" if n is not None else "an 8-byte header length"
            raise SpillError(f"{path}: expected {want}, found a file of {size} bytes; "
                             "the file is truncated or not safetensors, re-download it")
        if n > MAX_HEADER:
            raise SpillError(f"{path}: expected a JSON header of at most {MAX_HEADER // 1_000_000} MB, found one of "
                             f"{n} bytes; the file is not a usable safetensors file, re-download it")
        raw = os.pread(fd, n, 8)
        if hasattr(os, "posix_fadvise"):  # a header is read once; keep it out of the page cache
            os.posix_fadvise(fd, 0, -(-(8 + n) // 4096) * 4096, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        header = json.loads(raw)
    except RecursionError:
        raise SpillError(f"{path}: expected a flat JSON header, found one nested too deeply to read; "
                         f"{_REDOWNLOAD}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise SpillError(f"{path}: expected a JSON header, found invalid JSON ({_one_line(err)}); "
                         f"{_REDOWNLOAD}") from None
    if not isinstance(header, dict):
        raise SpillError(f"{path}: expected a JSON object as header, found {type(header).__name__}; {_REDOWNLOAD}")
    base = 8 + n
    specs = [_spec(path, name, entry, base, size) for name, entry in header.items() if name != "__metadata__"]
    specs.sort(key=lambda t: (t.offset, t.nbytes))
    for a, b in zip(specs, specs[1:]):
        if b.offset < a.offset + a.nbytes:
            raise SpillError(f"{path}: tensor {b.name} starts at data byte {b.offset - base}, inside {a.name} "
                             f"(data bytes {a.offset - base}-{a.offset - base + a.nbytes}); expected tensors "
                             f"that do not overlap, {_REDOWNLOAD}")
    return specs


def _spec(path: Path, name: str, entry, base: int, size: int) -> TensorSpec:
    try:
        dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if not (isinstance(dtype, str) and all(isinstance(x, int) and x >= 0 for x in (*shape, start, end))):
            raise TypeError
    except (TypeError, KeyError, ValueError):
        raise SpillError(f"{path}: tensor {name}: expected dtype, shape and data_offsets, found "
                         f"{json.dumps(entry)[:200]}; {_REDOWNLOAD}") from None
    if dtype not in ITEMSIZE:
        raise SpillError(f"{path}: tensor {name} has dtype {dtype}, expected one of {', '.join(ITEMSIZE)}; "
                         "convert the weights to a supported dtype")
    if end < start:
        raise SpillError(f"{path}: tensor {name} has data_offsets [{start}, {end}], expected start <= end; "
                         f"{_REDOWNLOAD}")
    want = math.prod(shape) * ITEMSIZE[dtype]
    if end - start != want:
        raise SpillError(f"{path}: tensor {name} ({dtype} {list(shape)}) needs {want} bytes, found data_offsets "
                         f"[{start}, {end}] of {end - start} bytes; {_REDOWNLOAD}")
    if base + end > size:
        raise SpillError(f"{path}: tensor {name} ends at byte {base + end}, found a file of {size} bytes; "
                         "the file is truncated, re-download it")
    return TensorSpec(name=name, path=path, offset=base + start, nbytes=end - start, dtype=dtype, shape=shape)


# -- layers ---------------------------------------------------------------------------------------
def _check_unique(folder: Path, tensors: list[TensorSpec]) -> None:
    seen: dict[str, Path] = {}
    for t in tensors:
        if t.name in seen:
            raise SpillError(f"model folder {folder}: tensor {t.name} is in both {seen[t.name].name} and "
                             f"{t.path.name}; expected each tensor once, remove the stray file")
        seen[t.name] = t.path


def _split_layers(folder: Path, tensors: list[TensorSpec], config: dict):
    by_layer: dict[int, list[TensorSpec]] = {}
    stacks: dict[str, int] = {}
    resident = []
    for t in tensors:
        m = _LAYER.search(t.name)
        if m is None:
            resident.append(t)
            continue
        by_layer.setdefault(int(m.group(1)), []).append(t)
        stack = t.name[: m.start(1)]
        stacks[stack] = stacks.get(stack, 0) + 1
    if len(stacks) > 1:
        found = ", ".join(f"{s}<i> ({k} tensors)" for s, k in stacks.items())
        raise SpillError(f"model folder {folder}: expected one stack of transformer layers, found {len(stacks)}: "
                         f"{found}; models with vision or audio towers are not supported yet")
    if not by_layer:
        raise SpillError(f"model folder {folder}: expected tensors named like model.layers.<i>.*, found none "
                         f"among {len(tensors)} tensors; this architecture is not supported")
    n = max(by_layer) + 1
    missing = [i for i in range(n) if i not in by_layer]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise SpillError(f"model folder {folder}: expected layers 0-{n - 1} with none missing, found no tensors "
                         f"for layer {shown}; a shard is missing or incomplete, re-download the model")
    want = config.get("num_hidden_layers", (config.get("text_config") or {}).get("num_hidden_layers"))
    if isinstance(want, int) and want != n:
        raise SpillError(f"model folder {folder}: config.json says num_hidden_layers={want}, found {n} layers "
                         "in the safetensors files; the weights and config.json do not match, re-download the model")
    return [by_layer[i] for i in range(n)], resident


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())
