"""Malformed input through the whole group: error lines for bad rows, refusals before any pass."""

import json
import shutil

from .group_util import read_output, spill

BAD = """{"custom_id": "ok", "prompt": "Hello there", "max_tokens": 4}
{"prompt": "no id"}
{"custom_id": "badurl", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}
{"custom_id": "broken", "prompt": 
{"custom_id": "long", "prompt": "%s", "max_tokens": 4}
"""


def test_bad_rows_become_error_lines_and_the_rest_runs(make_tiny, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(make_tiny("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 40   # a short context, so a long prompt cannot run
    (folder / "config.json").write_text(json.dumps(config))
    inp = tmp_path / "in.jsonl"
    inp.write_text(BAD % ("word " * 60).strip())
    result = spill("run", folder, inp, "-o", tmp_path / "out.jsonl")
    assert result.returncode == 3, result.stdout + result.stderr   # finished, with failed rows
    assert "done: 5/5 rows, 1 succeeded, 4 failed" in result.stdout
    out = read_output(tmp_path / "out.jsonl")
    assert set(out) == {"ok", "badurl", "broken", "long", None}
    assert out["ok"]["error"] is None and out["ok"]["response"]["status_code"] == 200
    errors = {cid: row["error"]["message"] for cid, row in out.items() if row["error"]}
    assert errors[None] == "line 2: custom_id is missing"
    assert errors["badurl"] == 'line 3: url must be "/v1/chat/completions" or "/v1/completions", found "/v1/embeddings"'
    assert errors["broken"] == "line 4: not valid JSON (Expecting value at column 35); write one JSON object per line"
    long_tokens = errors["long"].split()[5]
    assert errors["long"] == (f"line 5: the prompt is {long_tokens} tokens and max_tokens 4, {int(long_tokens) + 4} in all, "
                              "but the model's context is 40 tokens; shorten the prompt or lower max_tokens")
    assert out["long"]["response"] is None


def test_duplicate_custom_ids_are_refused_before_any_pass(make_tiny, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "b", "prompt": "y"}\n{"custom_id": "a", "prompt": "z"}\n')
    result = spill("run", make_tiny("llama"), inp, "-o", tmp_path / "out.jsonl")
    assert result.returncode == 2
    assert result.stderr.strip() == f"spill: {inp}: duplicate custom_id at lines 1 and 3 ('a'); give each row its own custom_id"
    assert not (tmp_path / "out.jsonl").exists()


def test_a_missing_model_is_one_sentence(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "prompt": "x"}\n')
    result = spill("run", tmp_path / "nope", inp)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"spill: model '{tmp_path / 'nope'}': expected a local model folder, a tag or "
                                     "a Hugging Face id (org/name), found no such folder; check the path")


def test_a_model_that_cannot_load_is_refused_with_one_sentence_before_any_group(make_tiny, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(make_tiny("llama"), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])   # truncated: the plan refuses it
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "prompt": "x"}\n')
    result = spill("run", folder, inp, "-o", tmp_path / "out.jsonl", timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"spill: {weights}: tensor ") and "found a file of" in last
    assert not (tmp_path / "out.jsonl").exists()
