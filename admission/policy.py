"""Which rows join the batch at which pass. The simple policy: first in, first out, under a cap
on running rows and a cap on prompt tokens started per pass. The memory-aware policy will sit
behind the same three calls."""

from collections import deque
from dataclasses import dataclass


@dataclass
class Waiting:
    row: int
    prompt_tokens: int
    payload: tuple            # what the streamer needs: (prompt ids, max_tokens, sampling)


class FifoPolicy:
    def __init__(self, max_rows: int = 64, prefill_tokens: int = 4096):
        self.max_rows = max_rows
        self.prefill_tokens = prefill_tokens
        self.queue: deque[Waiting] = deque()
        self.running: set[int] = set()

    def offer(self, rows: list[Waiting]) -> None:
        self.queue.extend(rows)

    def finished(self, rows: list[int]) -> None:
        self.running.difference_update(rows)

    def admit(self) -> list[Waiting]:
        """Rows to start now: in order, while a row fits; the first always fits an empty pass."""
        out, tokens = [], 0
        while self.queue and len(self.running) < self.max_rows:
            head = self.queue[0]
            if out and tokens + head.prompt_tokens > self.prefill_tokens:
                break
            out.append(self.queue.popleft())
            tokens += head.prompt_tokens
            self.running.add(head.row)
        return out

    def clear(self) -> None:
        self.queue.clear()
        self.running.clear()
