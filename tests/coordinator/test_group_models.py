"""Architecture classes through the front door: a warning for an unverified family, a refusal before
any pass for one spill cannot run."""

import json
import shutil

from .group_util import read_output, resident_texts, spill, texts, write_input


def _retyped(make_tiny, tmp_path, model_type: str, **extra):
    folder = tmp_path / "m"
    shutil.copytree(make_tiny("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type, **extra}))
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "prompt": "Hello", "max_tokens": 3}\n')
    return folder, inp


def test_an_expected_family_runs_after_a_one_line_warning(make_tiny, tmp_path):
    # granite: llama's weights and a few multipliers; mlx-lm supports it, spill has not verified it
    folder, inp = _retyped(make_tiny, tmp_path, "granite", logits_scaling=1.0, attention_multiplier=1.0,
                           embedding_multiplier=1.0, residual_multiplier=1.0)
    result = spill("run", folder, inp, "-o", tmp_path / "out.jsonl", "--quiet", check=True)
    assert ("warning: granite is a family mlx-lm supports but spill has not verified: it should run; "
            "`spill check MODEL` compares it with mlx-lm") in result.stdout.splitlines()
    assert read_output(tmp_path / "out.jsonl")["a"]["error"] is None


def test_a_mixture_of_experts_model_is_refused_before_any_pass(make_tiny, tmp_path):
    folder, inp = _retyped(make_tiny, tmp_path, "mixtral", num_local_experts=8)
    result = spill("run", folder, inp, "-o", tmp_path / "out.jsonl")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"spill: model '{folder}': mixtral is a mixture-of-experts model (num_local_experts = 8 in config.json): "
        "per-token expert routing defeats layer-order streaming; use a dense model")
    assert not (tmp_path / "out.jsonl").exists()


def test_a_gemma2_batch_through_the_group_matches_resident_mlx_lm(make_tiny, tmp_path):
    # grouped KV heads in a batch (the mask case mlx-lm's own batch path breaks on); EOS from both configs
    folder = make_tiny("gemma2")
    rows = write_input(tmp_path / "in.jsonl", 8)
    spill("run", folder, tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--quiet", check=True)
    assert texts(read_output(tmp_path / "out.jsonl")) == resident_texts(folder, rows)
