"""One row's generated text: incremental detokenization and stop strings.

mlx-lm's streaming detokenizer turns tokens into text as they arrive (for stop strings and the
live view); the final text is the tokenizer's own decode of every token, cut before the first
stop string (as the OpenAI API does). The streaming text may differ from it in leading spaces.
"""


class RowText:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self._tokenizer = tokenizer
        self._detok = tokenizer.detokenizer   # a fresh stateful copy per row
        self.stop = [s for s in (stop or []) if s]
        self.tokens: list[int] = []
        self.stopped = False
        self._scanned = 0   # streamed text before this index holds no stop string

    def add(self, token: int) -> bool:
        """Add a generated token; True once a stop string has appeared."""
        if self.stopped:
            return True
        self.tokens.append(token)
        self._detok.add_token(token)
        self.stopped = self._find_stop(self._detok.text, self._scanned) is not None
        self._scanned = len(self._detok.text)
        return self.stopped

    def finish(self) -> str:
        text = self._tokenizer.decode(self.tokens)
        cut = self._find_stop(text, 0)
        return text if cut is None else text[:cut]

    @property
    def text(self) -> str:
        """The text streamed so far (for the live view)."""
        return self._detok.text

    def _find_stop(self, text: str, scanned: int) -> int | None:
        if not self.stop:
            return None
        start = max(0, scanned - max(map(len, self.stop)) + 1)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None
