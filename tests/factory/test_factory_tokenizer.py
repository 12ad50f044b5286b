"""The locally trained tokenizer: exact vocab size, round trips, chat templates, cache."""

import json

import pytest
from mlx_lm.tokenizer_utils import load as load_mlx_tokenizer
from transformers import AutoTokenizer

from spill.factory.families import FAMILIES
from spill.factory.tokenizer import cache_path, train

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
RENDERED = {
    "llama": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
             "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
             "<|im_start|>assistant\n",
    "mistral": "<s>[INST] Be brief.\n\nHi there[/INST]",
    "qwen3": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
             "<|im_start|>assistant\n",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\n",
    "gemma2": "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "gemma3_text": "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n",
}
TEXT = "Streaming weights, layer by layer: 42 ≠ 43 — naïve café 東京\n\tdef f(x): return x**2\n"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_vocab_is_exact_and_every_id_decodes(make_tiny, family):
    folder = make_tiny(family)
    tok = AutoTokenizer.from_pretrained(folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    assert len(tok) == vocab
    assert all(isinstance(tok.decode([i]), str) for i in range(vocab))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_and_special_ids(make_tiny, family):
    folder = make_tiny(family)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(TEXT)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    tokens = FAMILIES[family].tokens
    assert config["bos_token_id"] == tok.convert_tokens_to_ids(tokens.config_bos)
    eos = generation["eos_token_id"]
    assert tok.convert_tokens_to_ids(tokens.eos) in (eos if isinstance(eos, list) else [eos])
    assert (ids[0] == tok.bos_token_id) == (tokens.bos is not None)  # llama3 and mistral add bos


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_template_renders_in_both_loaders(make_tiny, family):
    folder = make_tiny(family)
    hf = AutoTokenizer.from_pretrained(folder)
    assert hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == RENDERED[family]
    wrapped = load_mlx_tokenizer(folder)
    ids = wrapped.apply_chat_template(CHAT, add_generation_prompt=True)
    assert hf.decode(ids) == RENDERED[family]  # special tokens are single ids, not split text


def test_mistral_template_puts_system_in_last_user_turn(make_tiny):
    hf = AutoTokenizer.from_pretrained(make_tiny("mistral"))
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert hf.apply_chat_template(chat, tokenize=False) == "<s>[INST] a[/INST] b</s>[INST] S\n\nc[/INST]"


def test_training_is_deterministic_and_cached(make_tiny, spill_home):
    tokens = FAMILIES["qwen2"].tokens
    folder = make_tiny("qwen2")
    assert cache_path(tokens, 2048).parent == spill_home / "cache" / "tokenizers"
    assert cache_path(tokens, 2048).is_file()
    retrained = json.loads(train(tokens, 2048).to_str())
    assert retrained == json.loads((folder / "tokenizer.json").read_text())
