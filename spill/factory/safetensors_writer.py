"""Write safetensors files one tensor at a time, so a multi-GB model never sits in memory.

File layout (the safetensors format):

    [8 bytes: header length N, little-endian u64]
    [N bytes: JSON {"__metadata__": {"format": "pt"},
                    "model.embed_tokens.weight": {"dtype": "BF16", "shape": [2048, 128],
                                                  "data_offsets": [0, 524288]}, ...}
              padded with spaces to a multiple of 8]
    [tensor bytes, back to back in header order; offsets count from here]

Sharding packs tensors greedily in file order, as transformers does: a shard closes when
the next tensor would push it past the limit, a tensor larger than the limit gets a shard
of its own, and a layer may straddle two shards, as in real checkpoints.
"""

import json
import math
import re
import struct
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from spill.errors import SpillError

Tensor = tuple[str, tuple[int, ...]]  # name, shape

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size: str | int) -> int:
    """Bytes from an int or a string like "500MB", "2GB", "1.5GiB" (KB/MB/GB are powers of 10)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
        if not m or m.group(2).lower() not in _UNITS:
            raise SpillError(f"cannot read shard size {size!r}; "
                             "give a number of bytes or a size like 500MB or 2GB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise SpillError(f"shard size must be more than 0 bytes, got {size!r}; "
                         "give a size like 500MB or 2GB")
    return value


def plan_shards(tensors: list[Tensor], itemsize: int, max_bytes: int | None) -> list[list[Tensor]]:
    """Split tensors, in order, into shards of at most max_bytes (None: one shard)."""
    shards: list[list[Tensor]] = [[]]
    used = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * itemsize
        if max_bytes is not None and shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += nbytes
    return shards


def header_bytes(tensors: list[Tensor], dtype_tag: str, itemsize: int) -> bytes:
    """Length prefix + JSON header, padded so tensor data starts 8-byte aligned."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        end = offset + math.prod(shape) * itemsize
        header[name] = {"dtype": dtype_tag, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(path: Path, tensors: list[Tensor], dtype_tag: str, itemsize: int,
               blocks: Callable[[str, tuple[int, ...]], Iterable[np.ndarray]]) -> int:
    """Write one safetensors file; `blocks(name, shape)` yields each tensor's encoded values.

    Returns the number of tensor bytes written.
    """
    total = 0
    with open(path, "wb") as f:
        f.write(header_bytes(tensors, dtype_tag, itemsize))
        for name, shape in tensors:
            expected = math.prod(shape) * itemsize
            written = 0
            for block in blocks(name, shape):
                f.write(memoryview(block).cast("B"))
                written += block.nbytes
            if written != expected:
                raise RuntimeError(f"{name}: wrote {written} bytes, header says {expected}")
            total += written
    return total


def write_model(folder: Path, tensors: list[Tensor], dtype_tag: str, itemsize: int,
                blocks: Callable[[str, tuple[int, ...]], Iterable[np.ndarray]],
                max_bytes: int | None) -> list[str]:
    """model.safetensors, or model-0000i-of-0000N.safetensors shards plus their index.

    Returns the file names written.
    """
    shards = plan_shards(tensors, itemsize, max_bytes)
    if max_bytes is None:
        write_file(folder / "model.safetensors", tensors, dtype_tag, itemsize, blocks)
        return ["model.safetensors"]
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map: dict[str, str] = {}
    total = 0
    for file_name, shard in zip(names, shards):
        total += write_file(folder / file_name, shard, dtype_tag, itemsize, blocks)
        weight_map.update({name: file_name for name, _ in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names + ["model.safetensors.index.json"]
