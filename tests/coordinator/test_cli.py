"""The CLI as a user meets it: `spill make-model`, `spill check`, and one-line errors."""

import json
import shutil
import struct

from typer.testing import CliRunner

from spill.coordinator.cli import app

runner = CliRunner()


def test_check_prints_a_table_and_n_of_n_identical(make_tiny):
    result = runner.invoke(app, ["check", str(make_tiny("llama")), "--rows", "6", "--max-tokens", "5",
                                 "--prefill-chunk", "16"])
    assert result.exit_code == 0, result.output
    last = result.output.rstrip().splitlines()[-1]
    assert last.startswith("passed: teacher-forced max |Δ logit| ") and last.endswith("free-running 6/6 identical")
    assert result.output.rstrip().splitlines()[-2] == "identity 6/6, first-token 6/6"
    assert "the pass a row joined at" in result.output and "dtype float32 on the cpu; tolerance " in result.output


def test_check_in_bfloat16_states_dtype_tolerance_and_both_figures(make_tiny):
    result = runner.invoke(app, ["check", str(make_tiny("llama")), "--rows", "4", "--max-tokens", "5",
                                 "--prefill-chunk", "16", "--dtype", "bfloat16"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "dtype bfloat16 on the cpu; tolerance " in result.output
    assert "(4 x eps 7.8e-03 + 64 x float32 eps) x largest |logit|" in result.output
    last = result.output.rstrip().splitlines()[-1]
    assert last.startswith("passed: ") and "near-ties left out); free-running " in last


def test_check_with_quantized_kv_names_the_format_its_reference_and_both_figures(make_tiny):
    result = runner.invoke(app, ["check", str(make_tiny("llama")), "--rows", "3", "--max-tokens", "4",
                                 "--prefill-chunk", "16", "--kv-bits", "8", "--kv-group-size", "32"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "dtype float32 on the cpu; KV 8-bit (group 32) against mlx-lm's QuantizedKVCache; tolerance " in result.output
    assert "(4 x eps 1.2e-07 + 64 x float32 eps + 2^-8 (a step of the KV format)) x largest |logit|" in result.output
    last = result.output.rstrip().splitlines()[-1]
    assert last.startswith("passed: teacher-forced max |Δ logit| ") and last.endswith("free-running 3/3 identical")


def test_check_with_an_unknown_dtype_is_one_line(make_tiny):
    line = _one_line_error(["check", str(make_tiny("llama")), "--dtype", "fp8"])
    assert line == "spill: --dtype 'fp8' is not one of bfloat16, float16, float32; pick one of them or leave it out"


def test_make_model_writes_a_folder_check_accepts(tmp_path):
    out = tmp_path / "m"
    result = runner.invoke(app, ["make-model", str(out), "--family", "mistral", "--size", "tiny",
                                 "--shard-size", "1MB"])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors.index.json").exists()
    result = runner.invoke(app, ["check", str(out), "--rows", "3", "--max-tokens", "3"])
    assert result.output.rstrip().splitlines()[-1].endswith("free-running 3/3 identical")


def _copy(make_tiny, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(make_tiny("llama"), folder)
    return folder


def _one_line_error(args) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spill: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


def test_missing_folder(tmp_path):
    line = _one_line_error(["check", str(tmp_path / "nope")])
    assert line.endswith("found nothing at that path; check the path")


def test_folder_without_safetensors(make_tiny, tmp_path):
    folder = _copy(make_tiny, tmp_path)
    (folder / "model.safetensors").unlink()
    assert "expected *.safetensors weight files, found none" in _one_line_error(["check", str(folder)])


def test_truncated_safetensors(make_tiny, tmp_path):
    folder = _copy(make_tiny, tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    line = _one_line_error(["check", str(folder)])
    assert "model.safetensors: tensor" in line and "found a file of" in line


def test_header_that_lies_about_offsets(make_tiny, tmp_path):
    folder = _copy(make_tiny, tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start, end + 4]   # claims more bytes than its shape needs
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    path.write_bytes(data[:8] + raw + data[8 + n:])
    line = _one_line_error(["check", str(folder)])
    assert f"tensor {name}" in line and "needs" in line


def test_unsupported_model_type(make_tiny, tmp_path):
    folder = _copy(make_tiny, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "mamba"
    (folder / "config.json").write_text(json.dumps(config))
    assert _one_line_error(["check", str(folder)]) == (
        f"spill: model folder {folder}: mamba is a state-space or hybrid recurrent model: it has no KV cache "
        "to batch rows around, so spill cannot stream it; use a transformer model")


def test_unknown_family_for_make_model(tmp_path):
    assert _one_line_error(["make-model", str(tmp_path / "x"), "--family", "gpt9"]) == (
        "spill: unknown model family 'gpt9'; choose one of: llama, qwen2, mistral, qwen3, phi3, gemma2, gemma3_text")


def test_check_with_speculate_over_quantized_kv_passes_with_identity_gated(make_tiny):
    result = runner.invoke(app, ["check", str(make_tiny("llama")), "--rows", "3", "--max-tokens", "8", "--prefill-chunk",
                                 "16", "--speculate", "4", "--kv-bits", "8", "--kv-group-size", "32"],
                           terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "KV 8-bit (group 32) against mlx-lm's QuantizedKVCache" in result.output
    assert "drafts: up to 4 a pass by prompt lookup on the free-running rows" in result.output
    assert "identity gated" in result.output and result.output.rstrip().splitlines()[-1].startswith("passed: ")
