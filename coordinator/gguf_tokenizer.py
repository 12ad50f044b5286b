"""A GGUF file's byte-level BPE vocabulary as tokenizer.json and tokenizer_config.json, built with `tokenizers`.

The file holds the vocabulary, the merges and the special tokens, but only the *name* of the pre-tokenizer
(`tokenizer.ggml.pre`), which llama.cpp maps to its own split rules. A wrong split still tokenizes, into ids
the model was not trained on, so a name missing from `PRE` is refused rather than guessed.
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from spill.errors import SpillError
from spill.factory.tokenizer import SPLIT

CONTROL, USER_DEFINED = 3, 4   # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)


def _byte_level(regex: bool = True):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=regex)


def _digits_then_byte_level():
    # StarCoder's split, kept by SmolLM: every digit alone, then GPT-2's rules
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


PRE = {   # tokenizer.ggml.pre -> the Hugging Face pre-tokenizer with the same split
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
    "refact": _digits_then_byte_level,
    "gpt-2": _byte_level,
    "llama-bpe": lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
                                                  _byte_level(regex=False)]),
}


def build_tokenizer(meta: dict, src: Path) -> Tokenizer:
    """The fast tokenizer the file's tokenizer.ggml.* keys describe; one sentence for one spill cannot rebuild."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise SpillError(f"{src} has a {kind!r} tokenizer; spill rebuilds byte-level BPE vocabularies "
                         "(tokenizer.ggml.model 'gpt2') only: use the original Hugging Face checkpoint")
    if pre not in PRE:
        raise SpillError(f"{src} splits text by llama.cpp's {pre!r} rules, which spill cannot rebuild yet "
                         f"(it knows {', '.join(sorted(PRE))}); use the original Hugging Face checkpoint")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = PRE[pre]()
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]}:1 $B:1",
            special_tokens=[(tokens[bos], bos)])
    return tok


def write_tokenizer(meta: dict, folder: Path, src: Path) -> dict:
    """tokenizer.json and tokenizer_config.json in `folder`; returns the bos/eos/pad ids for config.json."""
    tok = build_tokenizer(meta, src)
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tok.save(str(folder / "tokenizer.json"))
    config = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"), "unk_token": token("unknown_token_id"),
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get("llama.context_length", 4096),
        "tokenizer_class": "PreTrainedTokenizerFast",   # tokenizer.json as written, never a class's own rules
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    # llama.cpp ends generation on each of these; one id stays a number, as in Hugging Face configs
    eos = list(dict.fromkeys(meta[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom")
                             if meta.get(f"tokenizer.ggml.{k}_token_id") is not None))
    return {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}
