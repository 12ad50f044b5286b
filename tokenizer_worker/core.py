"""The tokenizer worker's logic: prompts to real token ids, sampled tokens back to text.

Chat templates are rendered by the tokenizer's own `apply_chat_template` (transformers renders
them in a sandboxed Jinja environment); detokenization and stop strings are `RowText`'s.
"""

from dataclasses import dataclass
from pathlib import Path

from spill.errors import SpillError
from spill.messages import RowRequest

from .text import RowText

# transformers asks on a terminal, and raises elsewhere, when a tokenizer names code of its repo (auto_map)
NO_REMOTE_CODE = {"trust_remote_code": False}


def refuse_remote_code(err: Exception, folder) -> None:
    """One sentence for a tokenizer that needs its repo's own code, which spill never runs."""
    if isinstance(err, ValueError) and "trust_remote_code" in str(err):
        raise SpillError(f"model {folder}: its tokenizer needs code from the model's repository (auto_map), and "
                         "spill never runs a repository's code; use a model whose tokenizer loads without it") from None


def load_tokenizer(folder: Path, eos_token_ids=None):
    """mlx-lm's tokenizer loader with trust_remote_code off."""
    from mlx_lm.utils import load_tokenizer as load
    try:
        return load(folder, tokenizer_config_extra=NO_REMOTE_CODE, eos_token_ids=eos_token_ids)
    except ValueError as err:
        refuse_remote_code(err, folder)
        raise


@dataclass
class Live:
    text: RowText
    prompt_tokens: int
    completion_tokens: int = 0


class TokenizerCore:
    def __init__(self, model_folder: str | Path):
        from mlx_lm.utils import load_config
        folder = Path(model_folder)
        # EOS as mlx-lm takes it: generation_config.json, else config.json, plus the tokenizer's own
        config = load_config(folder)
        self.tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
        self.context = int(config.get("max_position_embeddings") or 0) or None
        self.eos = sorted(self.tokenizer.eos_token_ids)
        self.live: dict[int, Live] = {}

    def encode(self, request: RowRequest) -> list[int]:
        if request.kind == "chat":
            ids = self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True)
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        return self.tokenizer.encode(request.prompt)

    def tokenize_many(self, rows: list[int], requests: list[RowRequest], keep: bool = True) -> list[tuple[list[int] | None, str]]:
        """tokenize() of each row; plain prompts are encoded in one batch call, which gives the same
        ids at a fraction of the per-row cost (checked on the first; per row where they differ)."""
        plain = [k for k, r in enumerate(requests) if r.kind != "chat"]
        known: dict[int, list[int]] = {}
        if len(plain) > 1:
            batch = self.tokenizer._tokenizer([requests[k].prompt for k in plain])["input_ids"]
            if list(batch[0]) == self.encode(requests[plain[0]]):
                known = {k: list(ids) for k, ids in zip(plain, batch)}
        return [self.tokenize(row, r, known.get(k), keep) for k, (row, r) in enumerate(zip(rows, requests))]

    def tokenize(self, row: int, request: RowRequest, ids: list[int] | None = None,
                 keep: bool = True) -> tuple[list[int] | None, str]:
        """(prompt ids, "") for a row that can run, or (None, why not); `ids` when already encoded.
        keep: the row runs, so its text is followed (an estimate only wants the lengths)."""
        try:
            ids = self.encode(request) if ids is None else ids
        except Exception as err:  # a template that rejects these messages
            return None, f"the chat template could not render these messages ({str(err).splitlines()[0]})"
        if not ids:
            return None, "the prompt is empty after tokenization; give it some text"
        need = len(ids) + request.max_tokens
        if self.context and need > self.context:
            return None, (f"the prompt is {len(ids)} tokens and max_tokens {request.max_tokens}, "
                          f"{need} in all, but the model's context is {self.context} tokens; "
                          "shorten the prompt or lower max_tokens")
        if keep:
            self.live[row] = Live(RowText(self.tokenizer, request.stop), len(ids))
        return ids, ""

    def add(self, row: int, token: int, finish: str) -> tuple[bool, str | None]:
        """A sampled token. Returns (hit a stop string, finish reason if the row ended)."""
        live = self.live.get(row)
        if live is None:
            return False, None
        if finish == "preempted":   # its KV was dropped; it runs again from the prompt
            self.live[row] = Live(RowText(self.tokenizer, live.text.stop), live.prompt_tokens)
            return False, None
        if finish == "refused":     # the streamer would not start it (its error line is the coordinator's)
            self.live.pop(row)
            return False, None
        if finish == "stop":      # EOS: ends the row, is not text
            return False, "stop"
        if live.text.stopped:     # tokens sampled after the stop string are not the row's
            return True, "stop"
        live.completion_tokens += 1
        if live.text.add(token):
            return True, "stop"
        return False, finish or None

    def lost(self, row: int, position: int) -> bool:
        """A token whose row has a text of other than `position` tokens: some before it were lost on the way.
        The row is forgotten (the coordinator, seeing it outstanding while the group is idle, submits it again)."""
        live = self.live.get(row)
        if live is None or live.text.stopped or position == live.completion_tokens:
            return False
        self.live.pop(row)
        return True

    def finish(self, row: int, reason: str) -> tuple[str, str, int, int]:
        """(text, finish_reason, prompt_tokens, completion_tokens); forgets the row."""
        live = self.live.pop(row)
        return live.text.finish(), reason, live.prompt_tokens, live.completion_tokens

    def tails(self, rows: list[int], width: int = 80) -> tuple[list[int], list[str]]:
        return [self.live[r].completion_tokens for r in rows], [self.live[r].text.text[-width:] for r in rows]

    def forget(self, rows: list[int]) -> None:
        """Rows that ended with no text to follow (admission refused them)."""
        for row in rows:
            self.live.pop(row, None)

    def clear(self) -> None:
        self.live.clear()
