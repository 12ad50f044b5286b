"""One row's generated text: incremental detokenization and stop strings.

mlx-lm's streaming detokenizer turns tokens into text as they arrive; the row ends at the first
stop string, and the text returned stops before it (as the OpenAI API does).
"""


class RowText:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self._detok = tokenizer.detokenizer   # a fresh stateful copy per row
        self.stop = [s for s in (stop or []) if s]
        self._cut: int | None = None
        self._scanned = 0   # text before this index holds no stop string

    def add(self, token: int) -> bool:
        """Add a generated token; True once a stop string has appeared."""
        if self._cut is not None:
            return True
        self._detok.add_token(token)
        self._cut = self._find_stop(self._detok.text)
        return self._cut is not None

    def finish(self) -> str:
        self._detok.finalize()
        if self._cut is None:
            self._cut = self._find_stop(self._detok.text)
        return self.text

    @property
    def text(self) -> str:
        text = self._detok.text
        return text if self._cut is None else text[: self._cut]

    def _find_stop(self, text: str) -> int | None:
        if not self.stop:
            return None
        start = max(0, self._scanned - max(map(len, self.stop)) + 1)
        self._scanned = len(text)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None
