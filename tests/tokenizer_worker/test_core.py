"""The tokenizer worker's core: real prompt lengths, the context check, text and stop strings."""

import json
import shutil

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from spill.errors import SpillError
from spill.messages import RowRequest
from spill.tokenizer_worker.core import TokenizerCore


def test_chat_rows_use_the_template_and_completions_the_plain_encoding(make_tiny):
    folder = make_tiny("qwen2")
    core, tok = TokenizerCore(folder), load_tokenizer(folder)
    msgs = [{"role": "user", "content": "Hello"}]
    ids, why = core.tokenize(0, RowRequest(kind="chat", messages=msgs, max_tokens=4))
    assert why == "" and ids == list(tok.apply_chat_template(msgs, add_generation_prompt=True))
    ids, _ = core.tokenize(1, RowRequest(kind="completion", prompt="Hello", max_tokens=4))
    assert ids == tok.encode("Hello")


def test_a_row_past_the_context_is_refused_with_its_numbers(make_tiny, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(make_tiny("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 10
    (folder / "config.json").write_text(json.dumps(config))
    core = TokenizerCore(folder)
    n = len(core.encode(RowRequest(kind="completion", prompt="one two three", max_tokens=1)))
    ids, why = core.tokenize(0, RowRequest(kind="completion", prompt="one two three", max_tokens=10))
    assert ids is None
    assert why == (f"the prompt is {n} tokens and max_tokens 10, {n + 10} in all, but the model's context is "
                   "10 tokens; shorten the prompt or lower max_tokens")


def test_tokens_become_text_eos_ends_a_row_and_a_stop_string_cuts_it(make_tiny):
    folder = make_tiny("llama")
    core, tok = TokenizerCore(folder), load_tokenizer(folder)
    words = tok.encode("The cat sat on the mat.", add_special_tokens=False)
    core.tokenize(0, RowRequest(kind="completion", prompt="x", max_tokens=50))
    core.tokenize(1, RowRequest(kind="completion", prompt="x", max_tokens=50, stop=["on the"]))
    for t in words[:3]:
        assert core.add(0, t, "") == (False, None)
    assert core.add(0, core.eos[0], "stop") == (False, "stop")
    prompt_tokens = len(core.encode(RowRequest(kind="completion", prompt="x", max_tokens=1)))
    assert core.finish(0, "stop") == (tok.decode(words[:3]), "stop", prompt_tokens, 3)
    results = [core.add(1, t, "") for t in words]
    first_stop = next(k for k, (hit, _) in enumerate(results) if hit)
    assert results[first_stop] == (True, "stop")
    text, reason, _, completion = core.finish(1, "stop")
    assert text == "The cat sat " and reason == "stop" and completion == first_stop + 1


def _ids(folder, *tokens):
    tok = load_tokenizer(folder)
    return [tok.convert_tokens_to_ids(t) for t in tokens]


def test_eos_ids_come_from_the_config_files_as_well_as_the_tokenizer(make_tiny):
    folder = make_tiny("llama")   # config.json and generation_config.json list three EOS ids
    core = TokenizerCore(folder)
    assert core.eos == sorted(_ids(folder, "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"))


def test_generation_config_eos_replaces_config_json_eos_as_mlx_lm_does(make_tiny, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(make_tiny("qwen2"), folder)
    im_end, endoftext, im_start = _ids(folder, "<|im_end|>", "<|endoftext|>", "<|im_start|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_start]}))
    assert TokenizerCore(folder).eos == sorted({im_end, im_start})   # the tokenizer's eos stays
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = endoftext
    (folder / "config.json").write_text(json.dumps(config))
    assert TokenizerCore(folder).eos == sorted({im_end, endoftext})


def test_a_preempted_row_starts_its_text_again(make_tiny):
    core = TokenizerCore(make_tiny("llama"))
    ids, _ = core.tokenize(3, RowRequest(kind="completion", prompt="Hello", max_tokens=4, stop=["zz"]))
    first = core.tokenizer.encode(" world")
    for t in first:
        core.add(3, t, "")
    assert core.add(3, -1, "preempted") == (False, None)
    for t in first[:1]:
        core.add(3, t, "")
    text, reason, prompt, completion = core.finish(3, "length")
    assert (text, completion, prompt) == (core.tokenizer.decode(first[:1]), 1, len(ids))


def test_a_token_after_a_gap_in_its_row_forgets_the_row_not_writes_a_text_short_of_a_token(make_tiny):
    """The TOKENS of a pass lost on the way: the row's next token says it had 2 before it, the text has 1."""
    core = TokenizerCore(make_tiny("llama"))
    core.tokenize(4, RowRequest(kind="completion", prompt="Hello", max_tokens=6))
    words = core.tokenizer.encode(" the river runs")
    assert not core.lost(4, 0)
    core.add(4, words[0], "")
    assert not core.lost(4, 1)
    assert core.lost(4, 2) and 4 not in core.live
    assert core.add(4, words[2], "length") == (False, None)   # its later tokens are nobody's: no text is written
    assert not core.lost(5, 3)                                 # a row it does not hold is no gap


def remote_code_model(folder, tmp_path):
    """A copy of `folder` whose tokenizer names a class in a .py of the repo, which leaves a mark if run."""
    out = tmp_path / "remote"
    shutil.copytree(folder, out)
    conf = json.loads((out / "tokenizer_config.json").read_text())
    conf.update(auto_map={"AutoTokenizer": ["remote_tok.RemoteTokenizer", None]}, tokenizer_class="RemoteTokenizer")
    (out / "tokenizer_config.json").write_text(json.dumps(conf))
    (out / "remote_tok.py").write_text("import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('x')\n"
                                       "from transformers import PreTrainedTokenizerFast as RemoteTokenizer\n")
    return out


def test_a_tokenizer_asking_for_its_repos_code_is_refused_in_one_sentence_without_running_it(
        make_tiny, tmp_path, monkeypatch):
    folder = remote_code_model(make_tiny("llama"), tmp_path)
    asked = []   # transformers asks on a terminal when trust_remote_code is left unset; a user may say y
    monkeypatch.setattr("builtins.input", lambda *a: asked.append(a) or "y")
    with pytest.raises(SpillError) as err:
        TokenizerCore(folder)
    assert str(err.value) == (f"model {folder}: its tokenizer needs code from the model's repository (auto_map), "
                              "and spill never runs a repository's code; use a model whose tokenizer loads without it")
    assert not (folder / "RAN").exists() and asked == []


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3", "gemma2"])
def test_many_rows_at_once_get_the_ids_and_refusals_of_one_at_a_time(make_tiny, family):
    core = TokenizerCore(make_tiny(family))
    prompts = ["Say 1", "  two  spaces ", "naïve café ✓", "", "x" * 50, "line\nbreak\ttab", "Say 1"]
    requests = [RowRequest(kind="completion", prompt=p, max_tokens=4) for p in prompts]
    requests.insert(3, RowRequest(kind="chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4))
    one = [core.tokenize(row, r) for row, r in enumerate(requests)]
    core.clear()
    assert core.tokenize_many(list(range(len(requests))), requests) == one
    assert sorted(core.live) == [row for row, (ids, _) in enumerate(one) if ids is not None]


def test_rows_refused_downstream_are_forgotten(make_tiny):
    """Rows admission refuses (ENDED) or the streamer would not start ("refused" in TOKENS) leave no text behind."""
    core = TokenizerCore(make_tiny("llama"))
    for row in (1, 2, 3):
        core.tokenize(row, RowRequest(kind="completion", prompt="hello there", max_tokens=4, stop=[]))
    core.forget([1])
    assert core.add(2, -1, "refused") == (False, None)
    assert list(core.live) == [3]
