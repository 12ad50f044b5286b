"""Random values, bf16 rounding and shard planning."""

import json
import struct

import mlx.core as mx
import numpy as np

from spill.factory import weights
from spill.factory.safetensors_writer import header_bytes, plan_shards


def test_bfloat16_rounds_like_mlx():
    rng = np.random.default_rng(0)
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 0.0, -0.0, 1e-40],
                    dtype=np.float32)  # halfway cases round to even; a subnormal stays
    x = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 3, ties])
    expected = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    assert np.array_equal(weights.to_bfloat16(x.copy()), expected)


def test_values_depend_on_seed_and_name_only():
    def values(name, seed=0):
        return np.concatenate(list(weights.tensor_blocks(name, (300, 200), seed=seed, dtype="float32")))

    a = values("model.layers.0.mlp.up_proj.weight")
    assert np.array_equal(a, values("model.layers.0.mlp.up_proj.weight"))
    assert not np.array_equal(a, values("model.layers.1.mlp.up_proj.weight"))
    assert not np.array_equal(a, values("model.layers.0.mlp.up_proj.weight", seed=1))
    assert abs(a.std() - 200**-0.5) < 0.01 and abs(a.mean()) < 0.01  # fan-in scale


def test_norms_sit_near_their_init():
    x = np.concatenate(list(weights.tensor_blocks("model.norm.weight", (512,), seed=0, dtype="float32")))
    assert np.all(np.abs(x - 1.0) < 0.05)


def test_shards_pack_greedily_and_big_tensors_stand_alone():
    tensors = [("a", (10,)), ("b", (10,)), ("c", (100,)), ("d", (5,))]
    assert plan_shards(tensors, 2, 50) == [[("a", (10,)), ("b", (10,))], [("c", (100,))], [("d", (5,))]]
    assert plan_shards(tensors, 2, None) == [tensors]


def test_header_is_aligned_and_contiguous():
    raw = header_bytes([("w", (3, 5)), ("b", (7,))], "BF16", 2)
    (n,) = struct.unpack("<Q", raw[:8])
    assert n == len(raw) - 8 and n % 8 == 0
    header = json.loads(raw[8:])
    assert header["__metadata__"] == {"format": "pt"}
    assert header["w"] == {"dtype": "BF16", "shape": [3, 5], "data_offsets": [0, 30]}
    assert header["b"]["data_offsets"] == [30, 44]
