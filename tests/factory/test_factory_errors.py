"""Mistakes a user can fix give one line naming the fix, from the function and the CLI."""

import pytest
from typer.testing import CliRunner

from spill.coordinator.cli import app
from spill.errors import SpillError
from spill.factory import make_model
from spill.factory.safetensors_writer import parse_size


def error(tmp_path, **kwargs):
    args = {"family": "llama", **kwargs}
    with pytest.raises(SpillError) as info:
        make_model(tmp_path / "m", **args)
    assert not (tmp_path / "m").exists()
    return str(info.value)


def test_unknown_family(tmp_path):
    assert error(tmp_path, family="gpt2") == "unknown model family 'gpt2'; choose one of: llama, qwen2, mistral, qwen3, phi3, gemma2, gemma3_text"


def test_unknown_size(tmp_path):
    assert error(tmp_path, size="7b") == "unknown size preset '7b'; choose one of: tiny, small, tall, lean, lean45, 1b, 3b, deep"


def test_unknown_dtype(tmp_path):
    assert error(tmp_path, dtype="int8") == "unknown dtype 'int8'; choose one of: bfloat16, float16, float32"


def test_bad_shard_size(tmp_path):
    assert error(tmp_path, shard_size="lots") == \
        "cannot read shard size 'lots'; give a number of bytes or a size like 500MB or 2GB"
    assert error(tmp_path, shard_size=0) == \
        "shard size must be more than 0 bytes, got 0; give a size like 500MB or 2GB"


def test_output_folder_not_empty(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("keep me")
    with pytest.raises(SpillError) as info:
        make_model(tmp_path / "m", family="qwen2")
    assert str(info.value) == \
        f"output folder {tmp_path / 'm'} exists and is not empty; choose a new folder or empty it first"
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("text, expected", [
    ("500MB", 500 * 10**6), ("2GB", 2 * 10**9), ("1.5GiB", 3 * 2**29), ("64 kb", 64_000),
    ("123", 123), (4096, 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_cli_writes_a_sharded_model(tmp_path):
    out = tmp_path / "x"
    result = CliRunner().invoke(app, ["make-model", str(out), "--family", "qwen2", "--size", "tiny",
                                      "--shard-size", "1MB"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out.resolve())
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1


def test_cli_error_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["make-model", str(tmp_path / "x"), "--family", "gpt2"])
    assert result.exit_code == 2
    assert result.stderr == "spill: unknown model family 'gpt2'; choose one of: llama, qwen2, mistral, qwen3, phi3, gemma2, gemma3_text\n"
