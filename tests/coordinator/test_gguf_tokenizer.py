"""A GGUF vocabulary rebuilt as a fast tokenizer: the split its tokenizer.ggml.pre names, its special tokens,
and a refusal for what spill cannot rebuild (none of it needs the gguf package)."""

from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from spill.coordinator.gguf_tokenizer import build_tokenizer
from spill.errors import SpillError

ALPHABET = sorted(set(pre_tokenizers.ByteLevel.alphabet()))
TOKENS = ["<|endoftext|>", "<|im_end|>", *ALPHABET, "12", "Ġ1", "Ġ12"]
META = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.merges": ["Ġ 1", "Ġ1 2", "1 2"], "tokenizer.ggml.token_type": [3, 3] + [1] * (len(TOKENS) - 2),
        "tokenizer.ggml.eos_token_id": 1}


def _tokens(meta: dict, text: str) -> list[str]:
    return build_tokenizer(meta, Path("m.gguf")).encode(text).tokens


def test_smollm_splits_every_digit_where_gpt2_merges_them():
    assert _tokens(META, "a 12<|im_end|>") == ["a", "Ġ", "1", "2", "<|im_end|>"]
    assert _tokens({**META, "tokenizer.ggml.pre": "gpt-2"}, "a 12<|im_end|>") == ["a", "Ġ12", "<|im_end|>"]


def test_bos_is_added_only_where_the_file_asks_for_it():
    assert _tokens({**META, "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": True}, "a") == [
        "<|endoftext|>", "a"]
    assert _tokens({**META, "tokenizer.ggml.bos_token_id": 0}, "a") == ["a"]


@pytest.mark.parametrize("change, says", [
    ({"tokenizer.ggml.model": "llama"}, "m.gguf has a 'llama' tokenizer; spill rebuilds byte-level BPE vocabularies "
                                        "(tokenizer.ggml.model 'gpt2') only"),
    ({"tokenizer.ggml.pre": "qwen2"}, "m.gguf splits text by llama.cpp's 'qwen2' rules, which spill cannot rebuild yet"),
])
def test_a_tokenizer_spill_cannot_rebuild_is_refused_in_one_sentence(change, says):
    with pytest.raises(SpillError) as err:
        build_tokenizer({**META, **change}, Path("m.gguf"))
    assert str(err.value).startswith(says) and str(err.value).endswith("use the original Hugging Face checkpoint")
