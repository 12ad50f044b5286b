"""Random weights, deterministic from (seed, tensor name), drawn in fixed-size blocks.

Each block of BLOCK values has its own generator seeded from (seed, name, block index),
so a tensor's bytes never depend on sharding or on how the writer chunks it.

Scale: matrices get std = in_features ** -0.5, so every block's output has the scale
of its input; the layers then matter, the residual stream stays O(1) in bf16, and
greedy decoding gives varied tokens (with a 0.02 std the embedding dominates and a
tied model just repeats its input). Biases get std 0.02, norms norm_init +- a little. A family
that multiplies its embedding by sqrt(hidden) (gemma) draws it with std 1/hidden, to the same effect.
Values are uniform with that std: numpy draws uniforms ~4x faster than normals.
"""

import hashlib
import math
from typing import Iterator

import numpy as np

BLOCK = 1 << 22  # values per independently seeded block (16 MB of float32)

# storage dtype -> safetensors dtype tag, bytes per value
DTYPES: dict[str, tuple[str, int]] = {
    "bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4),
}


def init_for(name: str, shape: tuple[int, ...], norm_init: float = 1.0,
             scaled_embedding: bool = False) -> tuple[float, float]:
    """(mean, std) of a tensor's values, chosen from its name."""
    if scaled_embedding and name.endswith("embed_tokens.weight"):
        return 0.0, 1.0 / shape[-1]
    if name.endswith("norm.weight"):
        return norm_init, 0.02
    if name.endswith(".bias"):
        return 0.0, 0.02
    return 0.0, shape[-1] ** -0.5


def _generator(seed: int, name: str, block: int) -> np.random.Generator:
    digest = hashlib.sha256(name.encode()).digest()
    words = [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, block, *words])))


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits as little-endian uint16: round to nearest, ties to even.

    Overwrites x. Finite inputs only (the random weights always are).
    """
    bits = x.view(np.uint32)
    bits += np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
    return (bits >> 16).astype("<u2")


def encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the storage dtype's little-endian bytes, as an array."""
    if dtype == "bfloat16":
        return to_bfloat16(x)
    return x.astype("<f2" if dtype == "float16" else "<f4", copy=False)


def tensor_blocks(name: str, shape: tuple[int, ...], *, seed: int, dtype: str,
                  norm_init: float = 1.0, scaled_embedding: bool = False) -> Iterator[np.ndarray]:
    """The tensor's values in row-major order, one encoded block at a time."""
    n = math.prod(shape)
    mean, std = init_for(name, shape, norm_init, scaled_embedding)
    half = std * math.sqrt(3.0)  # uniform on [mean - half, mean + half] has this std
    for block, start in enumerate(range(0, n, BLOCK)):
        x = _generator(seed, name, block).random(min(BLOCK, n - start), dtype=np.float32)
        x *= np.float32(2 * half)
        x += np.float32(mean - half)
        yield encode(x, dtype)
