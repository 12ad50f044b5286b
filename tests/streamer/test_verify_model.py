"""The scheme the pass will run, on a real (tiny, random) model held resident by mlx-lm: each step feeds
[last, d1..dk] over the row's cache, verifies, and moves the cache back to what was accepted + 1. Greedy
text is the model's own whatever the drafts, a seeded sampled row's the same with lookup drafts as without;
accepted drafts save steps."""

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load_model

from spill.streamer.lookup import History
from spill.streamer.reference import resident_reference
from spill.streamer.sampling import SamplingParams
from spill.streamer.verify import Draft, verify

PROMPT = [5, 9, 13, 5, 9, 21, 34, 5, 9, 13, 2, 8]
STEPS = 40


@pytest.fixture(scope="module")
def model(make_tiny):
    m, _ = load_model(Path(make_tiny("llama")))
    m.set_dtype(mx.float32)
    return m


def speculative(model, drafter, k: int, params=SamplingParams()) -> tuple[list[int], int]:
    """STEPS greedy tokens after PROMPT, k drafts a step from drafter(history, k); -> (tokens, steps)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(PROMPT[:-1])[None], cache=cache))   # the cache holds all but the last token
    out, steps = [], 0
    while len(out) < STEPS:
        drafts = drafter(PROMPT + out, k)
        logits = model(mx.array([(PROMPT + out)[-1], *drafts])[None], cache=cache)[0].astype(mx.float32)
        v = verify(logits, [Draft(drafts, params, 7, len(out), STEPS - len(out))])[0]
        trim_prompt_cache(cache, len(drafts) - v.accepted)   # rejected drafts' KV goes
        out, steps = out + v.tokens, steps + 1
    return out, steps


def lookup(history, k):
    return History(history).propose(k)


@pytest.fixture(scope="module")
def greedy(model):
    return resident_reference(model, PROMPT, STEPS, set())[0]


def test_drafts_the_model_agrees_with_save_steps_and_change_no_token(model, greedy):
    oracle = lambda history, k: (greedy + [0] * k)[len(history) - len(PROMPT):][:k]   # noqa: E731
    tokens, steps = speculative(model, oracle, 4)
    assert tokens == greedy and steps == STEPS // 5


def test_drafts_it_rejects_cost_no_token_either(model, greedy):
    wrong = lambda history, k: [(t + 1) % 64 for t in (greedy + [0] * k)[len(history) - len(PROMPT):][:k]]  # noqa: E731
    assert speculative(model, wrong, 3) == (greedy, STEPS)


def test_prompt_lookup_drafts_give_the_models_own_text(model, greedy):
    tokens, steps = speculative(model, lookup, 4)
    assert tokens == greedy and steps < STEPS   # the random model repeats itself: lookup finds it


def test_a_seeded_sampled_row_gives_the_same_text_with_lookup_drafts_as_without(model):
    hot = SamplingParams(temperature=0.8, top_p=0.95)
    alone, steps = speculative(model, lambda history, k: [], 4, hot)
    assert speculative(model, lookup, 4, hot)[0] == alone and steps == STEPS
