"""Drafts verified inside the pass: plans that give decode rows a draft bound change no row's tokens
(greedy rows by verification, sampled rows by their own sampler) and take fewer passes on a repetitive prompt."""

import pytest

from spill.streamer.core import PassPlan, Row, Streamer
from spill.streamer.sampling import SamplingParams

PROMPTS = {"a": [5, 9, 13, 5, 9, 21, 34, 5, 9, 13, 2, 8, 5, 9, 13], "b": [7, 8, 9, 7, 8, 9, 7, 8],
           "c": [30, 31, 32, 33, 30, 31]}
SAMPLED = SamplingParams(temperature=0.8, seed=3)


def drive(folder, k: int, max_tokens: int = 24, eos: frozenset = frozenset(), widths=None) -> tuple[dict, dict]:
    """Every row started in one pass (in the pools of `widths`, row -> width), then decode passes with up to k
    drafts a row: ({row: (tokens, finish)}, {row: the passes it emitted in})."""
    s, widths = Streamer(folder, dtype=None), widths or {}
    rows = [Row(rid, p, max_tokens, SAMPLED if rid == "c" else SamplingParams(), eos, width=widths.get(rid, 0))
            for rid, p in PROMPTS.items()]
    out = {r.id: ([], None) for r in rows}
    pools = [[4, w] for w in sorted(set(widths.values()))] or None
    plan, passes = PassPlan(start=[(r, 1) for r in rows], chunks={1: 64}, pools=pools), {r.id: set() for r in rows}
    while True:
        for e in s.run(plan).emitted:
            passes[e.row_id].add(s.passes)
            tokens, finish = out[e.row_id]
            assert finish is None, f"{e.row_id} emitted after it ended"
            out[e.row_id] = (tokens + ([e.token] if e.finish != "stop" else []), e.finish)
        if s.idle:
            return out, passes
        plan = PassPlan(drafts={rid: k for rid in PROMPTS})


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])   # gemma3: sliding-window masks
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


def test_rows_in_pools_of_two_widths_draft_together_and_keep_their_tokens(make_tiny):
    folder, widths = make_tiny("qwen2", "float32"), {"a": 40, "b": 256, "c": 40}   # a: 39 tokens, its last drafts cut
    (plain, plain_passes), (spec, spec_passes) = drive(folder, 0, widths=widths), drive(folder, 4, widths=widths)
    assert spec == plain and sum(map(len, spec_passes.values())) < sum(map(len, plain_passes.values()))


def test_eos_ends_a_row_inside_an_accepted_run_where_it_would_have_without_drafts(make_tiny):
    folder = make_tiny("llama", "float32")
    tokens = drive(folder, 0)[0]["a"][0]
    eos = frozenset({next(t for t in tokens[12:] if t not in tokens[:12])})   # one row ends late, mid-run
    plain, spec = drive(folder, 0, eos=eos)[0], drive(folder, 4, eos=eos)[0]
    assert spec == plain and plain["a"] == (tokens[:tokens.index(min(eos))], "stop")



def test_the_actor_sends_each_rows_tokens_in_order_and_reports_the_drafts_accepted(make_tiny):
    from collections import Counter

    import numpy as np

    from spill import messages as m
    from spill.streamer.process import StreamerActor

    from .test_actor import plan
    runs = {}
    for k in (0, 4):
        actor = StreamerActor()
        actor.reset(m.Reset(1, str(make_tiny("llama", "float32"))))
        got, index = {10: [], 11: []}, 0
        out, stats, _ = actor.run(plan(0, [10, 11], [PROMPTS["a"], PROMPTS["b"]], max_tokens=16, chunks=[(1, 16)]))
        while True:
            out, stats = m.decode(m.encode(out)), m.decode(m.encode(stats))   # as they cross the wire
            for row, tok, at in zip(out.rows, np.frombuffer(out.tokens, np.int32).tolist(), out.positions):
                assert at == len(got[row])   # a row's tokens in order, each saying how many came before it
                got[row].append(tok)
            counts = Counter(out.rows)
            assert all(counts[row] == n + 1 for row, n in stats.accepted) and stats.emitted == len(out.rows)
            if actor.engine.idle:
                break
            index += 1
            out, stats, _ = actor.run(plan(index, drafts=[[10, k], [11, k]] if k else []))
        runs[k] = got, index
    assert runs[4][0] == runs[0][0] and runs[4][1] < runs[0][1]
