import json

import numpy as np
import pytest
from ._safetensors_util import make_model, model_tensors, write_raw, write_safetensors

from spill.errors import SpillError
from spill.streamer.plan import load_plan

LAYER_NAMES = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.o_proj.weight",
               "mlp.up_proj.weight", "mlp.down_proj.weight", "mlp.scales", "mlp.codes"]


def _check_bytes(plan, tensors):
    """Every spec points at exactly the bytes that were written for it."""
    for spec in [t for layer in plan.layers for t in layer] + plan.resident:
        code, arr = tensors[spec.name]
        assert (spec.dtype, spec.shape) == (code, arr.shape)
        with open(spec.path, "rb") as f:
            f.seek(spec.offset)
            assert f.read(spec.nbytes) == arr.tobytes()


def test_single_file(tmp_path):
    tensors = make_model(tmp_path, index=False, layers=3)
    plan = load_plan(str(tmp_path))
    assert plan.folder == tmp_path and plan.config["num_hidden_layers"] == 3
    assert [[t.name for t in layer] for layer in plan.layers] == [
        [f"model.layers.{i}.{n}" for n in LAYER_NAMES] for i in range(3)]
    assert [t.name for t in plan.resident] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert {t.path.name for t in plan.resident} == {"model.safetensors"}
    _check_bytes(plan, tensors)
    per_layer = sum(tensors[f"model.layers.0.{n}"][1].nbytes for n in LAYER_NAMES)
    assert [plan.layer_bytes(i) for i in range(3)] == [per_layer] * 3
    assert plan.streamed_bytes == 3 * per_layer
    assert plan.total_bytes == sum(arr.nbytes for _, arr in tensors.values())


def test_sharded_with_index_keeps_file_order_across_shards(tmp_path):
    tensors = make_model(tmp_path, shards=3, layers=4)
    plan = load_plan(tmp_path)
    assert len(plan.layers) == 4
    _check_bytes(plan, tensors)
    for layer in plan.layers:  # in file order: shard by shard, offsets ascending within one
        keys = [(t.path.name, t.offset) for t in layer]
        assert keys == sorted(keys)
    assert len({t.path for layer in plan.layers for t in layer}) == 3


def test_folder_of_shards_without_index(tmp_path):
    tensors = make_model(tmp_path, shards=2, index=False, layers=2)
    plan = load_plan(tmp_path)
    assert len(plan.layers) == 2 and len(plan.resident) == 3
    _check_bytes(plan, tensors)


def test_index_decides_which_files_are_read(tmp_path):
    make_model(tmp_path, shards=2, layers=2)
    write_safetensors(tmp_path / "stray.safetensors", {"model.layers.9.x": ("F32", np.zeros(2, np.float32))})
    assert len(load_plan(tmp_path).layers) == 2


def test_nested_layer_names_and_nested_layer_count(tmp_path):
    tensors = model_tensors(layers=2, prefix="model.language_model.")
    make_model(tmp_path, tensors, config={"model_type": "x", "text_config": {"num_hidden_layers": 2}})
    plan = load_plan(tmp_path)
    assert plan.layers[1][0].name == "model.language_model.layers.1.input_layernorm.weight"


# -- errors: one line each, naming the file, what was expected, what was found, what to do ---------
def _error(folder) -> str:
    with pytest.raises(SpillError) as info:
        load_plan(folder)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_folder_missing(tmp_path):
    assert _error(tmp_path / "nope") == (
        f"model folder {tmp_path}/nope: expected a folder with config.json and *.safetensors, "
        "found nothing at that path; check the path")


def test_not_a_folder(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert _error(tmp_path / "model.safetensors") == (
        f"model folder {tmp_path}/model.safetensors: expected a folder with config.json and *.safetensors, "
        "found a file; pass the folder that holds it")


def test_no_config(tmp_path):
    make_model(tmp_path)
    (tmp_path / "config.json").unlink()
    assert _error(tmp_path) == (
        f"model folder {tmp_path}: expected config.json, found none; copy the model's config.json into the folder")


def test_config_not_json(tmp_path):
    make_model(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    assert _error(tmp_path) == (
        f"{tmp_path}/config.json: expected a JSON object, found invalid JSON (Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1)); re-download config.json")


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    assert _error(tmp_path) == (
        f"model folder {tmp_path}: expected *.safetensors weight files, found none; spill reads "
        "safetensors only, save the weights with safe_serialization=True")


def test_index_names_missing_shard(tmp_path):
    make_model(tmp_path, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    assert _error(tmp_path) == (
        f"{tmp_path}/model.safetensors.index.json: names shard model-00002-of-00002.safetensors, found no "
        f"such file in {tmp_path}; download the missing shard")


def test_index_maps_tensor_the_shard_lacks(tmp_path):
    make_model(tmp_path, shards=2)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.layers.0.ghost"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    assert _error(tmp_path) == (
        f"{index}: maps model.layers.0.ghost to model-00001-of-00002.safetensors, found no such tensor in "
        "that file; re-download the model")


def test_header_length_past_end(tmp_path):
    make_model(tmp_path, index=False)
    write_raw(tmp_path / "model.safetensors", {}, b"", header_len=4096)
    assert _error(tmp_path) == (
        f"{tmp_path}/model.safetensors: expected a header of 4096 bytes after the 8-byte length, found a file "
        "of 16 bytes; the file is truncated or not safetensors, re-download it")


def test_file_shorter_than_header_length(tmp_path):
    make_model(tmp_path, index=False)
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    assert _error(tmp_path) == (
        f"{tmp_path}/model.safetensors: expected an 8-byte header length, found a file of 2 bytes; "
        "the file is truncated or not safetensors, re-download it")


def test_header_not_json(tmp_path):
    make_model(tmp_path, index=False)
    body = b'{"a": '
    (tmp_path / "model.safetensors").write_bytes(len(body).to_bytes(8, "little") + body)
    assert _error(tmp_path) == (
        f"{tmp_path}/model.safetensors: expected a JSON header, found invalid JSON (Expecting value: line 1 "
        "column 7 (char 6)); the file is corrupt, re-download it")


def _one_tensor(tmp_path, entry: dict, data: bytes = bytes(64), name="model.layers.0.w"):
    (tmp_path / "config.json").write_text("{}")
    write_raw(tmp_path / "model.safetensors", {name: entry}, data)
    return f"{tmp_path}/model.safetensors"


def test_unknown_dtype(tmp_path):
    f = _one_tensor(tmp_path, {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]})
    assert _error(tmp_path) == (
        f"{f}: tensor model.layers.0.w has dtype F4, expected one of BOOL, U8, I8, F8_E5M2, F8_E4M3, "
        "F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64, C64; convert the weights to a "
        "supported dtype")


def test_bad_entry(tmp_path):
    f = _one_tensor(tmp_path, {"dtype": "F32", "shape": [2]})
    assert _error(tmp_path) == (
        f'{f}: tensor model.layers.0.w: expected dtype, shape and data_offsets, found {{"dtype": "F32", '
        '"shape": [2]}; the file is corrupt, re-download it')


def test_offsets_end_before_start(tmp_path):
    f = _one_tensor(tmp_path, {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]})
    assert _error(tmp_path) == (
        f"{f}: tensor model.layers.0.w has data_offsets [8, 4], expected start <= end; "
        "the file is corrupt, re-download it")


def test_offsets_wrong_size(tmp_path):
    f = _one_tensor(tmp_path, {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]})
    assert _error(tmp_path) == (
        f"{f}: tensor model.layers.0.w (BF16 [2, 3]) needs 12 bytes, found data_offsets [0, 8] of 8 bytes; "
        "the file is corrupt, re-download it")


def test_offsets_overlap(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    write_raw(tmp_path / "model.safetensors", {
        "model.layers.0.a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "model.layers.0.b": {"dtype": "F32", "shape": [4], "data_offsets": [12, 28]}}, bytes(32))
    assert _error(tmp_path) == (
        f"{tmp_path}/model.safetensors: tensor model.layers.0.b starts at data byte 12, inside "
        "model.layers.0.a (data bytes 0-16); expected tensors that do not overlap, the file is corrupt, "
        "re-download it")


def test_truncated_file(tmp_path):
    tensors = make_model(tmp_path, index=False, layers=2)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    last = list(tensors)[-1]
    assert _error(tmp_path) == (
        f"{path}: tensor {last} ends at byte {len(data)}, found a file of {len(data) - 10} bytes; "
        "the file is truncated, re-download it")


def test_layer_gap(tmp_path):
    tensors = {k: v for k, v in model_tensors(layers=4).items() if ".layers.2." not in k}
    make_model(tmp_path, tensors, index=False, config={})
    assert _error(tmp_path) == (
        f"model folder {tmp_path}: expected layers 0-3 with none missing, found no tensors for layer 2; "
        "a shard is missing or incomplete, re-download the model")


def test_layer_count_differs_from_config(tmp_path):
    make_model(tmp_path, layers=3, config={"num_hidden_layers": 4})
    assert _error(tmp_path) == (
        f"model folder {tmp_path}: config.json says num_hidden_layers=4, found 3 layers in the safetensors "
        "files; the weights and config.json do not match, re-download the model")


def test_tensor_in_two_shards(tmp_path):
    tensors = make_model(tmp_path, shards=2, index=False, layers=2)
    write_safetensors(tmp_path / "model-00003-of-00002.safetensors",
                      {"model.norm.weight": tensors["model.norm.weight"]})
    assert _error(tmp_path) == (
        f"model folder {tmp_path}: tensor model.norm.weight is in both model-00002-of-00002.safetensors and "
        "model-00003-of-00002.safetensors; expected each tensor once, remove the stray file")


def test_no_layers(tmp_path):
    make_model(tmp_path, {"wte": ("F32", np.zeros(4, np.float32))}, index=False, config={})
    assert _error(tmp_path) == (
        f"model folder {tmp_path}: expected tensors named like model.layers.<i>.*, found none among 1 "
        "tensors; this architecture is not supported")


def test_two_layer_stacks(tmp_path):
    tensors = model_tensors(layers=2)
    tensors["vision_tower.encoder.layers.0.fc.weight"] = ("F32", np.zeros(4, np.float32))
    make_model(tmp_path, tensors, index=False, config={})
    assert _error(tmp_path) == (
        f"model folder {tmp_path}: expected one stack of transformer layers, found 2: model.layers.<i> "
        "(14 tensors), vision_tower.encoder.layers.<i> (1 tensors); models with vision or audio towers "
        "are not supported yet")
