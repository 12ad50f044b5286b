"""`spill check`: the same prompts through the streamer and through mlx-lm with the model resident.

Greedy tokens must be identical and logits within a tolerance (0.0 is expected in float32). The
rows exercise what the streamer does differently from mlx-lm: varied lengths in one batch, rows
joining mid-run, and a prompt long enough to be prefilled in several chunks.
"""

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from spill.errors import SpillError

from .core import Row, Streamer

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


@dataclass
class CheckRow:
    id: str
    prompt_tokens: int
    joined_pass: int
    expected: list[int]
    ref_logits: list = field(default_factory=list, repr=False)   # resident logits per step
    got: list[int] = field(default_factory=list)
    max_logit_diff: float = 0.0

    @property
    def identical(self) -> bool:
        return self.expected == self.got

    def first_difference(self) -> int | None:
        for k, (a, b) in enumerate(zip(self.expected, self.got)):
            if a != b:
                return k
        return None if len(self.expected) == len(self.got) else min(len(self.expected), len(self.got))


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


def join_schedule(n: int) -> dict[int, list[int]]:
    """Row indices added at each pass: most at pass 0, the rest join mid-run."""
    first = max(1, (n * 3) // 5)
    second = first + (n - first) // 2
    return {0: list(range(first)), 2: list(range(first, second)), 5: list(range(second, n))}


def resident_reference(model, prompt: list[int], max_tokens: int, eos: set[int]):
    """mlx-lm's own generate loop with the model resident; returns (tokens, logits per step)."""
    from mlx_lm.generate import generate_step
    logits = []

    def capture(_tokens, step_logits):
        logits.append(np.array(step_logits[0].astype(mx.float32)))
        return step_logits

    tokens = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, logits_processors=[capture]):
        if int(tok) in eos:
            break
        tokens.append(int(tok))
    return tokens, logits


def run_check(folder: str | Path, n: int = 20, max_tokens: int = 16, prefill_chunk: int = 128) -> list[CheckRow]:
    from mlx_lm.utils import load
    if n < 1:
        raise SpillError(f"--rows must be at least 1, got {n}")
    streamer = Streamer(folder, prefill_chunk=prefill_chunk, keep_logits=True)
    try:
        model, tokenizer = load(str(folder))
    except Exception as err:  # mlx-lm's own load failed after our plan accepted the folder
        raise SpillError(f"mlx-lm could not load {folder} as a resident reference: {err}") from err
    if streamer.dtype is not None:
        model.set_dtype(streamer.dtype)
    eos = set(tokenizer.eos_token_ids)
    prompts = check_prompts(tokenizer, n, long_tokens=3 * prefill_chunk)
    schedule = join_schedule(n)
    rows: dict[str, CheckRow] = {}
    for joined, indices in schedule.items():
        for i in indices:
            expected, ref_logits = resident_reference(model, prompts[i], max_tokens, eos)
            rows[str(i)] = CheckRow(str(i), len(prompts[i]), joined, expected, ref_logits)
    try:
        _stream(streamer, prompts, schedule, rows, max_tokens, frozenset(eos))
    finally:
        streamer.close()
    return [rows[str(i)] for i in range(n)]


def _stream(streamer, prompts, schedule, rows, max_tokens, eos) -> None:
    passes = 0
    while passes <= max(schedule) or not streamer.idle:
        for i in schedule.get(passes, []):
            streamer.add(Row(str(i), prompts[i], max_tokens, eos_ids=eos))
        for e in streamer.step().emitted:
            row = rows[e.row_id]
            k = len(row.got)
            if k < len(row.ref_logits):
                row.max_logit_diff = max(row.max_logit_diff, float(np.abs(row.ref_logits[k] - e.logits).max()))
            if e.finish != "stop":
                row.got.append(e.token)
        passes += 1
