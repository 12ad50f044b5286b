"""Generated tiny models load in mlx-lm with strict weights and give sane forward passes."""

import hashlib
import json
import struct

import mlx.core as mx
import pytest
from mlx_lm import load

from spill.factory import make_model
from spill.factory.presets import SIZES

FAMILIES = ["llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3_text"]
SHARD = 400_000  # bytes: a tiny model (~2-3 MB) splits into several shards


def header(path):
    """The JSON header of a safetensors file, keys in file order."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def tensors(folder):
    """name -> bf16 bits as a numpy uint16 array, from every safetensors file."""
    out = {}
    for path in sorted(folder.glob("model*.safetensors")):
        out.update({k: v.view(mx.uint16) for k, v in mx.load(str(path)).items()})
    return out


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shard_size", [None, SHARD])
def test_loads_strict_and_forward_is_finite(make_tiny, family, shard_size):
    folder = make_tiny(family, shard_size=shard_size)
    model, tokenizer = load(str(folder))  # strict=True: every weight name and shape must match
    prompt = tokenizer.encode("def add(a, b):\n    return a + b")
    logits = model(mx.array([prompt]))
    assert logits.shape == (1, len(prompt), SIZES["tiny"].vocab)
    assert mx.all(mx.isfinite(logits)).item()

    # greedy decoding of a random model still moves between tokens
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
    assert len(set(seq[len(prompt):])) > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_layout_and_index(make_tiny, family):
    folder = make_tiny(family, shard_size=SHARD)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (folder / "model.safetensors").exists()
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    weights = tensors(folder)
    assert set(index["weight_map"]) == set(weights)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in weights.values())
    for shard in shards:
        entries = {k: v for k, v in header(shard).items() if k != "__metadata__"}
        data = max(v["data_offsets"][1] for v in entries.values())
        assert data <= SHARD or len(entries) == 1  # the 512 KB embedding gets a shard of its own
        assert {k for k, f in index["weight_map"].items() if f == shard.name} == set(entries)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_matches_the_weights(make_tiny, family):
    folder = make_tiny(family)
    config = json.loads((folder / "config.json").read_text())
    shape = SIZES["tiny"]
    assert config["model_type"] == family
    assert (config["hidden_size"], config["num_hidden_layers"]) == (shape.hidden, shape.layers)
    assert config["vocab_size"] == shape.vocab and config["torch_dtype"] == "bfloat16"
    names = list(header(folder / "model.safetensors"))[1:]
    assert ("lm_head.weight" in names) == (not config["tie_word_embeddings"])
    assert config["tie_word_embeddings"] == (family in {"qwen2", "qwen3", "gemma2", "gemma3_text"})


def test_tensor_order_is_embedding_layers_norm_head(make_tiny):
    entries = header(make_tiny("mistral") / "model.safetensors")
    names = list(entries)[1:]
    assert names[0] == "model.embed_tokens.weight"
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"]
    layer_of = [int(n.split(".")[2]) for n in names[1:-2]]
    assert layer_of == sorted(layer_of)  # each layer's tensors are contiguous, layers in order
    offsets = [entries[name]["data_offsets"] for name in names]
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))


def test_same_seed_same_bytes(tmp_path, make_tiny):
    again = make_model(tmp_path / "again", family="qwen2", shard_size=SHARD)
    assert digest(again) == digest(make_tiny("qwen2", shard_size=SHARD))


def test_sharding_does_not_change_tensors(make_tiny):
    one, sharded = tensors(make_tiny("llama")), tensors(make_tiny("llama", shard_size=SHARD))
    assert one.keys() == sharded.keys()
    assert all(mx.array_equal(one[k], sharded[k]).item() for k in one)


def test_other_seed_other_weights(make_tiny):
    a, b = tensors(make_tiny("llama")), tensors(make_tiny("llama", seed=1))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not mx.array_equal(a[name], b[name]).item()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_other_dtypes_load(make_tiny, dtype):
    model, _ = load(str(make_tiny("qwen2", dtype=dtype)))
    assert model.model.embed_tokens.weight.dtype == getattr(mx, dtype)
    assert mx.all(mx.isfinite(model(mx.array([[1, 2, 3]])))).item()


def test_tie_override(tmp_path):
    folder = make_model(tmp_path / "tied", family="llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in header(folder / "model.safetensors")
    model, _ = load(str(folder))
    assert mx.all(mx.isfinite(model(mx.array([[5, 6]])))).item()


def test_reference_reader_accepts_the_files(make_tiny):
    safetensors = pytest.importorskip("safetensors")
    folder = make_tiny("qwen2", shard_size=SHARD)
    for path in folder.glob("model-*.safetensors"):
        with safetensors.safe_open(str(path), framework="np") as f:
            assert f.metadata() == {"format": "pt"}
            assert list(f.keys())


def test_output_folder_appears_whole(tmp_path):
    (tmp_path / "empty").mkdir()
    folder = make_model(tmp_path / "empty", family="mistral")
    assert folder == (tmp_path / "empty").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no partial folder left
