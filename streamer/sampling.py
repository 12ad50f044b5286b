"""Per-row sampling: greedy by default; temperature, top_k, top_p with a per-row seed."""

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from spill.messages import RowSampling as SamplingParams   # one row's, as the plan carries it


class RowSampler:
    """Draws one row's tokens; a seeded row gives the same tokens whatever batch it runs in. A sampled row of a
    speculating job (`verified`) takes `verify`'s seeded draws instead, from its `seed` (speculate.py)."""

    def __init__(self, params: SamplingParams, fallback_seed: int, verified: bool = False):
        self.params = params
        self.seed = params.seed if params.seed is not None else fallback_seed   # an unseeded row: the streamer's
        self.verified = verified and not params.greedy
        self._key = mx.random.key(self.seed)

    def __call__(self, logits: mx.array) -> mx.array:
        """logits [V] (float32) -> token id (scalar array)."""
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(target_logits(logits, self.params), key=sub)


def target_logits(logits: mx.array, p: SamplingParams) -> mx.array:
    """logits [..., V] -> the logits a sampled row draws from (softmax of them): top_k and top_p filter the
    untempered log-probabilities, then the temperature scales what is left. One rule for every path."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < p.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, p.top_k)
    if 0.0 < p.top_p < 1.0:
        logprobs = apply_top_p(logprobs, p.top_p)
    return logprobs * (1.0 / p.temperature)


def sample(logits: mx.array, samplers: list[RowSampler]) -> list[int]:
    """logits [B, V] -> one token per row; greedy rows share one argmax."""
    greedy = mx.argmax(logits, axis=-1)
    picks = [greedy[i] if s.params.greedy else s(logits[i]) for i, s in enumerate(samplers)]
    return mx.stack(picks).tolist() if picks else []
