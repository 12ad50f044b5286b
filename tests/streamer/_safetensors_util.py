"""Tiny safetensors model folders written with numpy, and a page-cache probe (mincore) for tests."""

import ctypes
import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np

# dtype code -> numpy dtype whose random bit patterns fill the tensor (bf16 as its uint16 bits)
BITS = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32, "I32": np.int32, "U8": np.uint8}
VIEW = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "I32": np.int32, "U8": np.uint8}


def random_tensor(rng: np.random.Generator, code: str, shape: tuple[int, ...]) -> np.ndarray:
    """Every bit pattern is fair game (NaNs included): the reader must move bytes, not values."""
    info = np.iinfo(BITS[code])
    bits = rng.integers(info.min, info.max, size=shape, dtype=BITS[code], endpoint=True)
    return bits.view(VIEW[code])


def write_raw(path: Path, header: dict, data: bytes, *, header_len: int | None = None) -> None:
    """A safetensors file from a header dict and data bytes (header_len: lie about its length)."""
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    n = len(h) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + h + data)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """tensors: name -> (dtype code, array holding the data), written in the given order."""
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (code, arr) in tensors.items():
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    write_raw(path, header, b"".join(blobs))


def model_tensors(layers: int = 3, hidden: int = 8, *, dtype: str = "BF16", seed: int = 0,
                  prefix: str = "model.") -> dict[str, tuple[str, np.ndarray]]:
    """Llama-shaped names and shapes, small; one int32 and one uint8 tensor per layer (never cast)."""
    rng = np.random.default_rng(seed)
    t = {f"{prefix}embed_tokens.weight": (dtype, random_tensor(rng, dtype, (32, hidden)))}
    for i in range(layers):
        p = f"{prefix}layers.{i}."
        for name, shape in [("input_layernorm.weight", (hidden,)),
                            ("self_attn.q_proj.weight", (hidden, hidden)),
                            ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("mlp.up_proj.weight", (2 * hidden, hidden)),
                            ("mlp.down_proj.weight", (hidden, 2 * hidden))]:
            t[p + name] = (dtype, random_tensor(rng, dtype, shape))
        t[p + "mlp.scales"] = ("I32", random_tensor(rng, "I32", (3,)))
        t[p + "mlp.codes"] = ("U8", random_tensor(rng, "U8", (5,)))
    t[f"{prefix}norm.weight"] = (dtype, random_tensor(rng, dtype, (hidden,)))
    t["lm_head.weight"] = (dtype, random_tensor(rng, dtype, (32, hidden)))
    return t


def make_model(folder: Path, tensors: dict | None = None, *, shards: int = 1, index: bool = True,
               config: dict | None = None, **kw) -> dict[str, tuple[str, np.ndarray]]:
    """A model folder: config.json and the tensors in `shards` files (model.safetensors if one and
    no index; else model-0000k-of-0000n.safetensors, with an index when `index`)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = tensors if tensors is not None else model_tensors(**kw)
    n_layers = len({n.split("layers.")[1].split(".")[0] for n in tensors if "layers." in n})
    cfg = {"model_type": "llama", "num_hidden_layers": n_layers} if config is None else config
    (folder / "config.json").write_text(json.dumps(cfg))
    names = list(tensors)
    if shards == 1 and not index:
        write_safetensors(folder / "model.safetensors", tensors)
        return tensors
    parts = np.array_split(np.arange(len(names)), shards)
    weight_map = {}
    for k, part in enumerate(parts):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(folder / file, {names[j]: tensors[names[j]] for j in part})
        weight_map.update({names[j]: file for j in part})
    if index:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return tensors


def cached_pages(path: Path) -> tuple[int, int]:
    """(pages of the file in the page cache, pages in the file), from mincore on a mapping that
    is never touched (so it faults nothing in). Linux only."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(v & 1 for v in vec), pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_from_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
