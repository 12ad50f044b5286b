"""Drafts from a small resident model (`--draft MODEL`): k tokens per decode row before each pass.

The draft model is loaded whole by mlx-lm (`load_model`) and keeps its own KV cache per row (mlx-lm's
cache objects), holding the row's tokens it has seen (`seen`). Before a pass the cache is cut back to
what it shares with the row's prompt and tokens (the drafts it proposed and the row did not keep go),
fed the rest, and the row's k drafts are taken one step at a time:

    row tokens   p p p p a b          (prompt p, generated a b)
    cache held   p p p p a x y        (x y: last pass's drafts; x was rejected for b)
    cut to       p p p p a            then fed b -> d1, then d1 -> d2 ... (k steps)

A greedy row's draft is the draft model's argmax. A sampled row's j-th draft is the draft model's own draw
(its distribution filtered by the row's temperature, top_k and top_p, as `sampling.target_logits`) by the
uniform the target draws its token at that output index with (`verify.uniforms`, stream 1): verification
keeps a draft where the target's draw equals it, so the row's text is the target's seeded draws whatever the
draft proposed or how many, and the draft only decides how many tokens a pass gives. The draft's
vocabulary must be the target's (`coordinator/submit.draft_refusal`); logits past the target's
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
    def __init__(self, folder, dtype, vocab: int):
        from mlx_lm.models.cache import make_prompt_cache
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

    def propose(self, wanted: list, live: set) -> dict[int, list[int]]:
        """wanted: (row state, k) -> id(row state) -> its k drafts; caches of rows not in `live` (ids) go."""
        for rid in [rid for rid in self.caches if rid not in live]:
            del self.caches[rid]
        return {id(r): self._row(r, k) for r, k in wanted}

    def clear(self) -> None:
        self.caches = {}

    def _row(self, r, k: int) -> list[int]:
        tokens = list(r.row.prompt) + r.tokens
        cache, seen = self.caches.get(r.row.id) or (self._new(self.model), [])
        keep = _shared(seen, tokens[:-1])
        if keep < len(seen):
            if all(c.is_trimmable() for c in cache):
                for c in cache:
                    c.trim(len(seen) - keep)
            else:   # a cache that cannot move back (a rotated window): a new one from the start
                cache, keep = self._new(self.model), 0
        for at in range(keep, len(tokens) - 1, CHUNK):   # what it has not seen but the last token: its KV only
            self.model(mx.array(tokens[at:min(at + CHUNK, len(tokens) - 1)], dtype=mx.int32)[None], cache=cache)
            mx.eval([c.state for c in cache])
        fed, out = tokens[-1:], []
        for j in range(k):
            logits = self.model(mx.array(fed, dtype=mx.int32)[None], cache=cache)[0, -1, :self.vocab]
            out.append(self._pick(logits.astype(mx.float32), r, len(r.tokens) + j))
            fed = out[-1:]
        self.caches[r.row.id] = (cache, tokens + out[:-1])
        return out

    @staticmethod
    def _pick(logits: mx.array, r, index: int) -> int:
        """The draft at output index `index`: the argmax (greedy), else the draft's draw by the target's uniform."""
        p = r.sampler.params
        if p.greedy:
            return int(mx.argmax(logits))
        q = mx.softmax(target_logits(logits[None], p), axis=-1)
        return int(draw(q, uniforms(r.sampler.seed, [index], 1))[0])


def _shared(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
