"""Prompt lookup: drafts from a row's own tokens (prompt and output), and from the job's finished outputs.

The row's last n tokens (n = 3, then 2, then 1) are looked up among the n-grams that ended earlier in its
history; the most recent earlier match proposes the k tokens that followed it:

    position  0   1   2   3 4   5   6   7 8   9
    history   the cat sat . the cat ran . the cat      last 3 ". the cat": latest earlier at 3-5
    proposes                            ran . the cat  (k = 4: what followed position 5)

Each n-gram is a key (the ids packed 21 bits apiece) mapped to the end of its latest occurrence: a sorted
run of distinct keys in numpy (16 bytes each) and a dict of the newest, merged into the run every 128
(`Ngrams`): about 60 bytes a token. Drafts never rescan a history; an appended token adds 3 keys. A match in the
job's finished outputs (`Outputs`) is tried after the row's own at each length, before a shorter one.
"""

import numpy as np

BITS = 21                     # bits of a token id in a packed n-gram: vocabularies below 2M ids
LONGEST = 3                   # n-grams looked up, longest first


def packed(tokens, n: int) -> np.ndarray:
    """The n-grams of `tokens` ending at positions n-1.. as ints: the last token in the lowest bits."""
    t = np.asarray(tokens, dtype=np.int64)
    if t.size and (t.min() < 0 or t.max() >> BITS):
        raise ValueError(f"token ids must be in [0, {1 << BITS}) for prompt lookup, found {t.min()}..{t.max()}")
    keys = np.zeros(max(t.size - n + 1, 0), dtype=np.int64)
    for m in range(n):
        keys |= t[n - 1 - m:t.size - m] << (BITS * m)
    return keys


class Ngrams:
    """Packed n-gram -> the latest value stored for it (values grow with time): a sorted run and the newest."""
    MERGE = 128

    def __init__(self):
        self.keys = np.zeros(0, dtype=np.int64)     # sorted, distinct
        self.values = np.zeros(0, dtype=np.int64)
        self.newest: dict[int, int] = {}

    def add(self, key: int, value: int) -> None:
        self.newest[key] = value
        if len(self.newest) >= self.MERGE:
            self.merge()

    def merge(self, keys: np.ndarray = None, values: np.ndarray = None) -> None:
        """The newest (and `keys`, `values`, later than all stored) into the sorted run, the latest of each key kept."""
        k = np.concatenate([self.keys, np.fromiter(self.newest, np.int64, len(self.newest))]
                           + ([keys] if keys is not None else []))
        v = np.concatenate([self.values, np.fromiter(self.newest.values(), np.int64, len(self.newest))]
                           + ([values] if values is not None else []))
        order = np.lexsort((v, k))
        k, v = k[order], v[order]
        last = np.append(k[1:] != k[:-1], True)[:k.size]
        self.keys, self.values, self.newest = k[last], v[last], {}

    def get(self, key: int) -> int | None:
        value = self.newest.get(key)
        if value is not None:
            return value
        i = int(np.searchsorted(self.keys, key, side="right")) - 1
        return int(self.values[i]) if i >= 0 and self.keys[i] == key else None


class History:
    """One row's tokens and the index of the n-grams that end before its last token."""

    def __init__(self, prompt, index_output: bool = True):
        t = np.asarray(prompt, dtype=np.int64).reshape(-1)
        self.tokens = np.zeros(max(2 * t.size, 64), dtype=np.int32)   # grown by doubling
        self.tokens[:t.size] = t
        self.size = t.size
        self.index_output = index_output    # False: only the prompt proposes (to measure the sources apart)
        # n -> the position of the last token of each n-gram's latest occurrence, positions before the last
        self._index = {n: Ngrams() for n in range(1, LONGEST + 1)}
        for n, grams in self._index.items():
            grams.merge(packed(t[:-1], n), np.arange(n - 1, t.size - 1, dtype=np.int64))

    def extend(self, tokens) -> None:
        """Append tokens the row took; the n-grams they complete join the index (the last one's, next time)."""
        for t in tokens:
            if self.index_output and self.size:
                self._add(self.size - 1)
            if self.size == self.tokens.size:
                self.tokens = np.concatenate([self.tokens, np.zeros_like(self.tokens)])
            if not 0 <= t < 1 << BITS:
                raise ValueError(f"token ids must be in [0, {1 << BITS}) for prompt lookup, found {t}")
            self.tokens[self.size] = t
            self.size += 1

    def _add(self, end: int) -> None:
        key = 0
        for n in range(1, min(LONGEST, end + 1) + 1):
            key |= int(self.tokens[end - n + 1]) << (BITS * (n - 1))
            self._index[n].add(key, end)

    def propose(self, k: int, outputs: "Outputs | None" = None) -> list[int]:
        """Up to k drafts: what followed the latest earlier match of the last 3, 2 or 1 tokens (the row's own
        first at each length, then `outputs`); none where nothing matches."""
        if k <= 0 or not self.size:
            return []
        longest = min(LONGEST, self.size)
        last = self.tokens[self.size - longest:self.size].tolist()
        for n in range(longest, 0, -1):
            key = 0
            for m, t in enumerate(reversed(last[-n:])):
                key |= t << (BITS * m)
            end = self._index[n].get(key)
            if end is not None:
                return self.tokens[end + 1:min(end + 1 + k, self.size)].tolist()
            if outputs is not None:
                found = outputs.follow(key, n, k)
                if found:
                    return found
        return []


class Outputs:
    """The job's finished outputs and the index of their n-grams: drafts for rows of one template. Keeps the
    newest `capacity` tokens or so: past it, the older half goes and the index is rebuilt (amortized O(1))."""

    def __init__(self, capacity: int = 1 << 20):
        self.capacity = capacity
        self._texts: dict[int, np.ndarray] = {}   # number -> an output's tokens, oldest first
        self._index = {n: Ngrams() for n in range(1, LONGEST + 1)}   # packed n-gram -> number << 32 | end
        self._size = self._next = 0

    def add(self, tokens) -> None:
        """A finished output (its tokens, EOS excluded)."""
        text = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if text.size < 2:
            return
        self._texts[self._next] = text.astype(np.int32)
        self._size += text.size
        self._index_text(self._next, text)
        self._next += 1
        if self._size > self.capacity:
            self._shrink()

    def _index_text(self, number: int, text: np.ndarray) -> None:
        for n, grams in self._index.items():   # an n-gram ending at the last token has nothing after it
            grams.merge(packed(text[:-1], n), (number << 32) + np.arange(n - 1, text.size - 1, dtype=np.int64))

    def _shrink(self) -> None:
        kept, size = [], 0
        for number in sorted(self._texts, reverse=True):
            if size >= self.capacity // 2:
                break
            kept.append(number)
            size += self._texts[number].size
        self._texts = {n: self._texts[n] for n in sorted(kept)}
        self._index = {n: Ngrams() for n in range(1, LONGEST + 1)}
        for number, text in self._texts.items():
            self._index_text(number, text)
        self._size = size

    def follow(self, key: int, n: int, k: int) -> list[int]:
        """Up to k tokens after the latest output n-gram equal to `key` (packed); [] where none."""
        hit = self._index[n].get(key)
        if hit is None:
            return []
        end = hit & 0xFFFFFFFF
        return self._texts[hit >> 32][end + 1:end + 1 + k].tolist()

    def __len__(self) -> int:
        return self._size
