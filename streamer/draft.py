"""Drafts from a small resident model (`--draft MODEL`): k tokens per decode row before each pass.

The draft model is loaded whole by mlx-lm (`load_model`) and keeps its own KV cache per row (mlx-lm's
cache objects), holding the row's tokens it has seen (`seen`). Before a pass the cache is cut back to
what it shares with the row's prompt and tokens (the drafts it proposed and the row did not keep go),
fed the rest, and the row's k drafts are taken one step at a time:

    row tokens   p p p p a b          (prompt p, generated a b)
    cache held   p p p p a x y        (x y: last pass's drafts; x was rejected for b)
    cut to       p p p p a            then fed b -> d1, then d1 -> d2 ... (k steps)

Every row's steps run as one batch: each cache is cut back to all but the row's last m tokens (m the most any
row lacks, so the first step feeds every row m tokens), the caches are merged into mlx-lm's BatchKVCache
(left-padded to the longest row), and split back into each row's after its k steps. A model whose caches
cannot merge (sliding windows: RotatingKVCache) steps a row at a time.

A greedy row's draft is the draft model's argmax. A sampled row's j-th draft is the draft model's own draw
(its distribution filtered by the row's temperature, top_k and top_p, as `sampling.target_logits`) by the
uniform the target draws its token at that output index with (`verify.uniforms`, stream 1): verification
keeps a draft where the target's draw equals it, so the row's text is the target's seeded draws whatever the
draft proposed or how many, and the draft only decides how many tokens a pass gives. The draft's
vocabulary must be the target's (`coordinator/submit.vocabulary_refusal`); logits past the target's
vocab_size (a padded embedding) are cut off.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np

from spill.errors import SpillError

from .sampling import target_logits
from .verify import draw, uniforms

CHUNK = 512   # prompt tokens the draft model takes a step when it catches up (its logits never computed)


class DraftModel:
    def __init__(self, folder, dtype, vocab: int | None):
        from mlx_lm.models.cache import KVCache, make_prompt_cache
        from mlx_lm.utils import load_config, load_model

        from .families.rope import rope_config
        self.folder, self.vocab, self._new = str(folder), vocab, make_prompt_cache
        try:
            self.model, _ = load_model(Path(folder), model_config=rope_config(load_config(Path(folder)), folder))
        except Exception as err:   # noqa: BLE001 - one sentence, no traceback
            raise SpillError(f"--draft {folder}: mlx-lm could not load it ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}); give a model folder mlx-lm runs") from None
        if dtype is not None:
            self.model.set_dtype(dtype)
        mx.eval(self.model.parameters())
        self.caches: dict = {}   # row id -> (its cache, the tokens it holds)
        # rows' steps batched where every layer's cache is a plain KVCache (BatchKVCache merges those)
        self.batched = all(type(c) is KVCache for c in make_prompt_cache(self.model))

    def propose(self, wanted: list, live: set) -> dict[int, list[int]]:
        """wanted: (row state, k) -> id(row state) -> its k drafts; caches of rows not in `live` (ids) go."""
        for rid in [rid for rid in self.caches if rid not in live]:
            del self.caches[rid]
        if len(wanted) > 1 and self.batched:
            return self._together(wanted)
        return {id(r): self._steps([r], k, 1)[0][:k] for r, k in wanted}

    def clear(self) -> None:
        self.caches = {}

    def _together(self, wanted: list) -> dict[int, list[int]]:
        """Every row's k steps in one batch: each cache cut back (or fed) to all but its last m tokens, m the most
        any row lacks, then merged into mlx-lm's BatchKVCache (left-padded) and split again after."""
        rows, tokens = [r for r, _ in wanted], [list(r.row.prompt) + r.tokens for r, _ in wanted]
        held = [_shared(self.caches[r.row.id][1], t[:-1]) if r.row.id in self.caches else 0 for r, t in zip(rows, tokens)]
        m = min(max(len(t) - h for t, h in zip(tokens, held)), min(map(len, tokens)))
        drafts = self._steps(rows, max(k for _, k in wanted), m)
        return {id(r): d[:k] for (r, k), d in zip(wanted, drafts)}

    def _steps(self, rows: list, k: int, m: int) -> list[list[int]]:
        """k drafts of each row: its cache made to hold all but its last m tokens, which the first step feeds."""
        from mlx_lm.models.cache import BatchKVCache
        tokens = [list(r.row.prompt) + r.tokens for r in rows]
        caches = [self._held(r, t, len(t) - m) for r, t in zip(rows, tokens)]
        cache = caches[0] if len(rows) == 1 else [BatchKVCache.merge(list(c)) for c in zip(*caches)]
        fed, out = mx.array([t[-m:] for t in tokens], dtype=mx.int32), [[] for _ in rows]
        for j in range(k):
            logits = self.model(fed, cache=cache)[:, -1, :self.vocab].astype(mx.float32)
            for i, tok in enumerate(self._pick(logits, rows, j)):
                out[i].append(tok)
            fed = mx.array([d[-1:] for d in out], dtype=mx.int32)
        for i, (r, t) in enumerate(zip(rows, tokens)):
            self.caches[r.row.id] = (cache if len(rows) == 1 else [c.extract(i) for c in cache], t + out[i][:-1])
        return out

    def _held(self, r, tokens: list[int], n: int) -> list:
        """The row's cache holding exactly its first n tokens: cut back to what it shares with them, fed the rest."""
        cache, seen = self.caches.get(r.row.id) or (self._new(self.model), [])
        keep = min(_shared(seen, tokens), n)
        if keep < len(seen):
            if all(c.is_trimmable() for c in cache):
                for c in cache:
                    c.trim(len(seen) - keep)
            else:   # a cache that cannot move back (a rotated window): a new one from the start
                cache, keep = self._new(self.model), 0
        for at in range(keep, n, CHUNK):   # its KV only: the logits of these positions are never computed
            self.model(mx.array(tokens[at:min(at + CHUNK, n)], dtype=mx.int32)[None], cache=cache)
            mx.eval([c.state for c in cache])
        return cache

    def _pick(self, logits: mx.array, rows: list, j: int) -> list[int]:
        """logits [rows, V] -> each row's j-th draft: the argmax (greedy), else the draft model's draw by the
        uniform the target draws that output index with."""
        top = mx.argmax(logits, axis=-1).tolist()
        for i, r in enumerate(rows):
            p = r.sampler.params
            if not p.greedy:
                q = mx.softmax(target_logits(logits[i:i + 1], p), axis=-1)
                top[i] = int(draw(q, uniforms(r.sampler.seed, [len(r.tokens) + j], 1))[0])
        return top


def _shared(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
