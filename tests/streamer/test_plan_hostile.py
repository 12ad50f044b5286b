"""Hostile model folders: one sentence each, read no further than needed (issue 8, finding 6)."""

import json
import struct

import pytest

from spill.errors import SpillError
from spill.streamer.plan import load_plan

from ._safetensors_util import make_model

MAX_HEADER = 100_000_000


def test_a_header_over_100_mb_is_refused_before_it_is_read(tmp_path):
    make_model(tmp_path, index=False, layers=2)
    shard = tmp_path / "model.safetensors"
    with open(shard, "r+b") as f:    # claims a 200 MB header; the file is sparse, nothing is written
        f.write(struct.pack("<Q", 2 * MAX_HEADER))
        f.truncate(8 + 2 * MAX_HEADER + 64)
    with pytest.raises(SpillError) as err:
        load_plan(tmp_path)
    assert str(err.value) == (f"{shard}: expected a JSON header of at most 100 MB, found one of {2 * MAX_HEADER} "
                              "bytes; the file is not a usable safetensors file, re-download it")


@pytest.mark.parametrize("where", ["header", "config", "index"])
def test_deeply_nested_json_is_one_sentence_not_a_recursion_error(tmp_path, where):
    make_model(tmp_path, shards=2, layers=2)
    deep = b"[" * 200_000 + b"]" * 200_000
    if where == "header":
        shard = tmp_path / "model-00001-of-00002.safetensors"
        shard.write_bytes(struct.pack("<Q", len(deep)) + deep)
        path, want = shard, "expected a flat JSON header, found one nested too deeply to read"
    else:
        path = tmp_path / ("config.json" if where == "config" else "model.safetensors.index.json")
        path.write_bytes(deep)
        want = "nested too deeply" if where == "config" else "expected JSON with a \"weight_map\""
    with pytest.raises(SpillError) as err:
        load_plan(tmp_path)
    assert str(err.value).startswith(f"{path}: ") and want in str(err.value)


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors"])
def test_a_shard_name_that_escapes_the_folder_is_refused(tmp_path, name):
    folder = tmp_path / "model"
    make_model(folder, shards=2, layers=2)
    (folder / "model-00002-of-00002.safetensors").rename(tmp_path / "outside.safetensors")
    name = str(tmp_path / "outside.safetensors") if name == "ABSOLUTE" else name
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = {k: (name if v.endswith("00002.safetensors") else v) for k, v in doc["weight_map"].items()}
    index.write_text(json.dumps(doc))
    with pytest.raises(SpillError) as err:
        load_plan(folder)
    assert str(err.value) == (f"{index}: names shard {name!r}, expected a file name inside {folder}; "
                              "the index is not safe to use, re-download it")
