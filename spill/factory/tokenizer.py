"""A byte-level BPE tokenizer trained locally, cached per (style, vocab size).

The training text is the Python standard library's own .py and .txt files, read in
sorted order, so any machine with Python can train it without a download and training
is deterministic (for one Python version, which is part of the cache key). The vocabulary
is exactly `vocab` ids, special tokens included, so every id a model can emit decodes:
if the text yields too few merges, reserved tokens in the family's style fill the gap.
"""

import hashlib
import os
import sys
from pathlib import Path
from typing import Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from spill import config
from spill.factory.families import Tokens
from spill.files import replaced

CACHE_VERSION = 1  # bump when the training code changes, so old cached tokenizers are not reused

# Split text like tiktoken's cl100k (Llama 3, Qwen2): contractions, words, 1-3 digit runs,
# punctuation runs, newlines, spaces; then map bytes to printable characters.
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def cache_path(tokens: Tokens, vocab: int) -> Path:
    """One file per (style, vocab), keyed also by what changes the result when edited."""
    recipe = repr((CACHE_VERSION, SPLIT, tokens.specials, tokens.specials_first, tokens.filler, tokens.bos))
    key = hashlib.sha256(recipe.encode()).hexdigest()[:8]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return config.home() / "cache" / "tokenizers" / f"{tokens.style}-{vocab}-{py}-{key}.json"


def corpus(budget: int) -> Iterator[str]:
    """Standard-library source text in sorted path order, about `budget` characters."""
    root = os.path.dirname(os.__file__)
    used = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            if not name.endswith((".py", ".txt")):
                continue
            with open(os.path.join(folder, name), encoding="utf-8", errors="ignore") as f:
                text = f.read()
            yield text
            used += len(text)
            if used >= budget:
                return


def train(tokens: Tokens, vocab: int) -> Tokenizer:
    """Train a byte-level BPE with exactly `vocab` ids, specials where the family puts them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    first = list(tokens.specials) if tokens.specials_first else []
    bpe_size = vocab if tokens.specials_first else vocab - len(tokens.specials)
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size, special_tokens=first, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # ~300 characters of text per token is enough for the merges to fill the vocab
    tok.train_from_iterator(corpus(max(1_000_000, 300 * vocab)), trainer=trainer)

    # fill missing merges with reserved tokens, then add the trailing specials
    start = len(tokens.specials)
    fillers = [tokens.filler.format(start + i) for i in range(bpe_size - tok.get_vocab_size())]
    trailing = fillers if tokens.specials_first else fillers + list(tokens.specials)
    tok.add_special_tokens(trailing)
    assert tok.get_vocab_size() == vocab, (tok.get_vocab_size(), vocab)

    if tokens.bos is not None:
        bos = (tokens.bos, tok.token_to_id(tokens.bos))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens.bos} $A", pair=f"{tokens.bos} $A {tokens.bos}:1 $B:1",
            special_tokens=[bos])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def load_or_train(tokens: Tokens, vocab: int) -> Tokenizer:
    """The cached tokenizer for (style, vocab), training and caching it the first time."""
    path = cache_path(tokens, vocab)
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = train(tokens, vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replaced(path) as tmp:   # parallel runs never read a half-written file
        tok.save(str(tmp))
    return tok


def tokenizer_config(tokens: Tokens, max_length: int) -> dict:
    """tokenizer_config.json: the special tokens by name, the chat template, the fast class."""
    return {
        "add_bos_token": tokens.bos is not None,
        "add_eos_token": False,
        "bos_token": tokens.bos,
        "chat_template": tokens.chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": tokens.eos,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": max_length,
        "pad_token": tokens.pad,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": tokens.unk,
    }
