"""`spill check`'s resident side: mlx-lm's own model and generate loop, in a process of its own. Building a streamer
swaps the attention of mlx-lm's model module for spill's (families/base.py), for the whole process; a reference
run beside it would run spill's attention too, and a defect there would pass the gate unseen."""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import mlx.core as mx
import numpy as np

from spill.errors import SpillError

_TOPICS = [
    "Why is the sky blue?",
    "Write a haiku about disks.",
    "List three prime numbers.",
    "Explain what a transformer layer computes, step by step, for a reader new to the field.",
    "Translate 'good morning' into French.",
    "What is 17 times 23?",
    "Summarise the plot of a story where a lighthouse keeper finds a message in a bottle.",
    "Name the planets of the solar system in order from the sun.",
    "Give a one-line definition of entropy.",
    "Describe how a bicycle stays upright while moving, and why it falls over when it stops.",
]
_FILLER = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill, "
           "and the miller counts sacks of flour by lamplight. ")


def resident_side(folder: str | Path, dtype: str | None, n: int, max_tokens: int, long_tokens: int,
                  kv: dict | None = None) -> dict:
    """In a fresh process: the prompts, the EOS ids, the dtype the resident model computed in, and per prompt the
    resident's tokens of every step (an EOS included), its logits per step and mlx_lm.generate's first token.
    `kv`: mlx-lm's own quantized KV cache from the first token on (kv_bits, kv_group_size); None: unquantized."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(_resident, str(folder), dtype, n, max_tokens, long_tokens, kv).result()
        except BrokenProcessPool:
            raise SpillError(f"the resident reference for {folder} stopped before it finished; it holds the whole "
                             "model in memory: run `spill check` where that fits, or with fewer --rows") from None
        except SpillError:
            raise
        except Exception as err:  # noqa: BLE001 - mlx-lm failed on this device or format: one sentence, no traceback
            first = str(err).splitlines()[0] if str(err) else ""
            raise SpillError(f"mlx-lm's resident reference failed on {folder} ({type(err).__name__}: {first}); "
                             "nothing to compare against: check a format mlx-lm runs here") from None


def _resident(folder: str, dtype: str | None, n: int, max_tokens: int, long_tokens: int, kv: dict | None) -> dict:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load, load_config

    from spill.tokenizer_worker.core import NO_REMOTE_CODE, refuse_remote_code

    from .families.rope import rope_config
    config = rope_config(load_config(Path(folder)), folder)   # RoPE settings as the streamer reads them
    try:
        model, tokenizer = load(folder, tokenizer_config=NO_REMOTE_CODE, model_config=config, trust_remote_code=False)
    except Exception as err:  # mlx-lm's own load failed after our plan accepted the folder
        refuse_remote_code(err, folder)
        raise SpillError(f"mlx-lm could not load {folder} as a resident reference: {err}") from None
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    used = next(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    eos = set(tokenizer.eos_token_ids)
    prompts = check_prompts(tokenizer, n, long_tokens)
    kv = dict(kv, quantized_kv_start=0) if kv else {}
    rows = [(*resident_reference(model, p, max_tokens, eos, **kv), first_token(model, tokenizer, p))
            for p in prompts]
    spread = quantized_spread(model, prompts, rows, kv) if kv else 0.0
    return {"prompts": prompts, "eos": sorted(eos), "dtype": str(used).removeprefix("mlx.core."), "rows": rows,
            "spread": spread}


def quantized_spread(model, prompts: list[list[int]], rows: list, kv: dict) -> float:
    """How far mlx-lm's own quantized-KV logits move when every weight moves by about one rounding step of its dtype
    (seeded), teacher-forced on the same tokens: a value near a quantization boundary rounds the other way, a whole
    KV step, and the layers after it carry that on. The check's tolerance allows twice it (each side moved once)."""
    from mlx.utils import tree_map
    original, key = model.parameters(), mx.random.key(0)

    def jitter(w):
        nonlocal key
        if not mx.issubdtype(w.dtype, mx.floating):
            return w
        key, sub = mx.random.split(key)
        return (w * (1 + float(mx.finfo(w.dtype).eps) * mx.random.normal(w.shape, key=sub))).astype(w.dtype)

    model.update(tree_map(jitter, original))
    try:
        spread = 0.0
        for prompt, (tokens, logits, _) in zip(prompts, rows):
            moved = _forced_quantized(model, prompt, tokens[:len(logits)], kv)
            spread = max([spread] + [float(np.abs(a - b).max()) for a, b in zip(logits, moved)])
        return spread
    finally:
        model.update(original)


def _forced_quantized(model, prompt: list[int], tokens: list[int], kv: dict) -> list:
    """Logits per step as resident_reference computes them with quantized KV, fed `tokens` instead of its own."""
    logits: list = []
    cache, _ = _quantized_prompt(model, prompt, kv, logits)
    for t in tokens[:-1]:
        logits.append(np.array(model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32)))
    return logits


def check_prompts(tokenizer, n: int, long_tokens: int) -> list[list[int]]:
    """n prompts of varied length; the last is at least `long_tokens` long (chunked prefill)."""
    prompts = [_encode(tokenizer, _TOPICS[k % len(_TOPICS)] + " " + _FILLER * (k % 4)) for k in range(n - 1)]
    repeats = 1
    while len(long := _encode(tokenizer, _FILLER * repeats)) < long_tokens:
        repeats += 1
    return prompts + [long]


def _encode(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer.encode(text)


def resident_reference(model, prompt: list[int], max_tokens: int, eos: set[int], **kv):
    """mlx-lm's own generate loop with the model resident; returns (tokens of every step, an EOS
    included, logits per step)."""
    from mlx_lm.generate import generate_step
    logits = []

    def capture(_tokens, step_logits):
        logits.append(np.array(step_logits[0].astype(mx.float32)))
        return step_logits

    tokens, cache = [], None
    if kv:   # the prompt unquantized, its KV quantized once after it (as a row joins a pool), then mlx-lm's own decode
        cache, prompt = _quantized_prompt(model, prompt, kv, logits)
        tokens.append(prompt[0])
        if prompt[0] in eos or max_tokens == 1:
            return tokens, logits
        max_tokens -= 1
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, logits_processors=[capture],
                                prompt_cache=cache, **kv):
        tokens.append(int(tok))
        if int(tok) in eos:
            break
    return tokens, logits


def _quantized_prompt(model, prompt: list[int], kv: dict, logits: list) -> tuple[list, list[int]]:
    """The prompt through mlx-lm's model and cache, its logits kept, the cache turned into mlx-lm's quantized one:
    (that cache, [the greedy first token])."""
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    first = model(mx.array(prompt)[None], cache=cache)[0, -1].astype(mx.float32)
    logits.append(np.array(first))
    cache = [c.to_quantized(group_size=kv["kv_group_size"], bits=kv["kv_bits"]) for c in cache]
    return cache, [int(mx.argmax(first))]


def first_token(model, tokenizer, prompt: list[int]) -> int:
    """The first token mlx_lm.generate gives for the prompt, greedy, in a call of its own."""
    from mlx_lm.generate import stream_generate
    return next(iter(stream_generate(model, tokenizer, mx.array(prompt), max_tokens=1))).token
