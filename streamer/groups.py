"""Rows and groups of rows that run through a layer together.

A prefill group holds prompts left-padded to one length, e.g. prompts [1 3 5], [7], [2 6 8 9]:

    0 1 3 5        left_padding = [1, 3, 0]
    0 0 0 7        mlx-lm's BatchKVCache masks the padding and starts RoPE at 0 for each row
    2 6 8 9

It feeds `chunk` columns per pass; after its last column it samples a first token for each row
and becomes a decode group (one token per row per pass), which merges into the running one.
"""

import mlx.core as mx
import numpy as np


class RowState:
    def __init__(self, row, sampler):
        self.row = row
        self.sampler = sampler
        self.tokens: list[int] = []      # generated so far, EOS excluded
        self.finish: str | None = None   # "stop" or "length" once ended

    def accept(self, token: int) -> str | None:
        """Record a sampled token (or the teacher's at this position); return why the row ends, if it does."""
        teacher = self.row.teacher
        if teacher is not None and len(self.tokens) < len(teacher):
            token = teacher[len(self.tokens)]
        if token in self.row.eos_ids:
            return "stop"
        self.tokens.append(token)
        return "length" if len(self.tokens) >= self.row.max_tokens else None


class Group:
    def __init__(self, rows: list[RowState], caches: list, prompt: np.ndarray | None = None):
        self.rows = rows
        self.caches = caches              # one BatchKVCache per layer
        self.prompt = prompt              # [B, L] left-padded ids while prefilling, else None
        self.done = 0                     # prompt columns already computed
        self._step = 0

    @classmethod
    def prefill(cls, rows: list[RowState], adapter) -> "Group":
        width = max(len(r.row.prompt) for r in rows)
        pads = [width - len(r.row.prompt) for r in rows]
        prompt = np.zeros((len(rows), width), dtype=np.int32)
        for j, r in enumerate(rows):
            prompt[j, pads[j]:] = r.row.prompt
        caches = [adapter.make_cache(i, pads) for i in range(len(adapter.layers))]
        return cls(rows, caches, prompt)

    @property
    def prefilling(self) -> bool:
        return self.prompt is not None

    def next_tokens(self, chunk: int) -> mx.array:
        """This pass's input ids [B, T]."""
        if self.prefilling:
            self._step = min(chunk, self.prompt.shape[1] - self.done)
            return mx.array(self.prompt[:, self.done:self.done + self._step])
        return mx.array([[r.tokens[-1]] for r in self.rows], dtype=mx.int32)

    def advance(self) -> bool:
        """After a pass: True when the group's last position should be sampled."""
        if self.prefilling:
            self.done += self._step
            if self.done < self.prompt.shape[1]:
                return False
            self.prompt = None
        return True

    def merge(self, other: "Group") -> "Group":
        for mine, theirs in zip(self.caches, other.caches):
            mine.extend(theirs)
        self.rows = self.rows + other.rows
        return self

    def without_finished(self) -> "Group | None":
        keep = [j for j, r in enumerate(self.rows) if r.finish is None]
        if not keep:
            return None
        if len(keep) < len(self.rows):
            idx = mx.array(keep)
            for c in self.caches:
                c.filter(idx)
            self.rows = [self.rows[j] for j in keep]
        return self


def bucket(rows: list[RowState], max_rows: int = 64, slack: float = 1.25) -> list[list[RowState]]:
    """Split new rows into prefill groups of similar prompt length, so padding stays small."""
    out: list[list[RowState]] = []
    for r in sorted(rows, key=lambda r: len(r.row.prompt)):
        if out and len(out[-1]) < max_rows and len(r.row.prompt) <= slack * len(out[-1][0].row.prompt) + 8:
            out[-1].append(r)
        else:
            out.append([r])
    return out
