"""Drafts verified inside the pass: plans that give decode rows a draft bound change no row's tokens
(greedy rows by verification, sampled rows by their own sampler) and take fewer passes on a repetitive prompt."""

import pytest

from spill.streamer.core import PassPlan, Row, Streamer
from spill.streamer.sampling import SamplingParams

PROMPTS = {"a": [5, 9, 13, 5, 9, 21, 34, 5, 9, 13, 2, 8, 5, 9, 13], "b": [7, 8, 9, 7, 8, 9, 7, 8],
           "c": [30, 31, 32, 33, 30, 31]}
SAMPLED = SamplingParams(temperature=0.8, seed=3)


def drive(folder, k: int, max_tokens: int = 24) -> tuple[dict, dict]:
    """Every row started in one pass, then decode passes with up to k drafts a row:
    ({row: (tokens, finish)}, {row: the passes it emitted in})."""
    s = Streamer(folder, dtype=None)
    rows = [Row(rid, p, max_tokens, SAMPLED if rid == "c" else SamplingParams()) for rid, p in PROMPTS.items()]
    out = {r.id: ([], None) for r in rows}
    plan, passes = PassPlan(start=[(r, 1) for r in rows], chunks={1: 64}), {r.id: set() for r in rows}
    while True:
        for e in s.run(plan).emitted:
            passes[e.row_id].add(s.passes)
            tokens, finish = out[e.row_id]
            assert finish is None, f"{e.row_id} emitted after it ended"
            out[e.row_id] = (tokens + ([e.token] if e.finish != "stop" else []), e.finish)
        if s.idle:
            return out, passes
        plan = PassPlan(drafts={rid: k for rid in PROMPTS})


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rows_with_drafts_give_the_same_tokens_in_fewer_passes(make_tiny, family):
    folder = make_tiny(family, "float32")
    plain, plain_passes = drive(folder, 0)
    spec, spec_passes = drive(folder, 4)
    assert spec == plain
    assert all(len(t) == 24 and f == "length" for t, f in plain.values())
    assert len(spec_passes["c"]) == len(plain_passes["c"])                # sampled: a token a pass
    assert sum(map(len, spec_passes.values())) < sum(map(len, plain_passes.values()))


def test_a_row_near_max_tokens_drafts_only_what_it_may_still_take(make_tiny):
    folder = make_tiny("llama", "float32")
    assert drive(folder, 8, max_tokens=3)[0] == drive(folder, 0, max_tokens=3)[0]

