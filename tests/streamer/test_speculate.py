"""Drafts verified inside the pass: plans that give decode rows a draft bound change no greedy row's tokens and
take fewer passes on a repetitive prompt, over unquantized or quantized KV; a sampled row of a speculating job drafts
too, and its text depends only on its seed (the same whatever it drafted, alone or beside other rows, run after run)."""

from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest

from spill.streamer.core import PassPlan, Row, Streamer
from spill.streamer.sampling import SamplingParams, target_logits
from spill.streamer.verify import uniforms
from spill.typed import AUTO_DRAFTS

PROMPTS = {"a": [5, 9, 13, 5, 9, 21, 34, 5, 9, 13, 2, 8, 5, 9, 13], "b": [7, 8, 9, 7, 8, 9, 7, 8],
           "c": [30, 31, 32, 33, 30, 31]}
SAMPLED = SamplingParams(temperature=0.8, seed=3)


class Run(NamedTuple):
    out: dict        # row -> (tokens, finish)
    passes: dict     # row -> the passes it emitted in
    accepted: dict   # row -> drafts it accepted
    logits: dict     # row -> each token's logits (keep_logits)


def drive(folder, k: int, max_tokens: int = 24, eos: frozenset = frozenset(), widths=None, sampling=None,
          speculate: int = 0, keep_logits: bool = False, prompts=PROMPTS, kv=None) -> Run:
    """Every row started in one pass (in the pools of `widths`, row -> width; sampled as `sampling` says, row ->
    params, else c sampled and the rest greedy; KV as `kv` says), then decode passes with up to k drafts a row."""
    s = Streamer(folder, dtype=None, speculate=speculate, keep_logits=keep_logits, **(kv or {}))
    widths = widths or {}
    sampling = sampling or {"c": SAMPLED}
    rows = [Row(rid, p, max_tokens, sampling.get(rid, SamplingParams()), eos, width=widths.get(rid, 0))
            for rid, p in prompts.items()]
    run = Run({r.id: ([], None) for r in rows}, {r.id: set() for r in rows}, {r.id: 0 for r in rows},
              {r.id: [] for r in rows})
    pools = [[4, w] for w in sorted(set(widths.values()))] or None
    plan = PassPlan(start=[(r, 1) for r in rows], chunks={1: 64}, pools=pools)
    while True:
        report = s.run(plan)
        for e in report.emitted:
            run.passes[e.row_id].add(s.passes)
            tokens, finish = run.out[e.row_id]
            assert finish is None, f"{e.row_id} emitted after it ended"
            run.out[e.row_id] = (tokens + ([e.token] if e.finish != "stop" else []), e.finish)
            run.logits[e.row_id].append(e.logits)
        for rid, n in report.accepted.items():
            run.accepted[rid] += n
        if s.idle:
            return run
        plan = PassPlan(drafts={rid: k for rid in prompts})


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])   # gemma3: sliding-window masks
def test_rows_with_drafts_give_the_same_tokens_in_fewer_passes(make_tiny, family):
    folder = make_tiny(family, "float32")
    (plain, plain_passes, *_), (spec, spec_passes, *_) = drive(folder, 0), drive(folder, 4)
    assert spec == plain
    assert all(len(t) == 24 and f == "length" for t, f in plain.values())
    assert len(spec_passes["c"]) == len(plain_passes["c"])                # sampled: a token a pass
    assert sum(map(len, spec_passes.values())) < sum(map(len, plain_passes.values()))


def test_a_row_near_max_tokens_drafts_only_what_it_may_still_take(make_tiny):
    folder = make_tiny("llama", "float32")
    assert drive(folder, 8, max_tokens=3).out == drive(folder, 0, max_tokens=3).out


def test_rows_in_pools_of_two_widths_draft_together_and_keep_their_tokens(make_tiny):
    folder, widths = make_tiny("qwen2", "float32"), {"a": 40, "b": 256, "c": 40}   # a: 39 tokens, its last drafts cut
    (plain, plain_passes, *_), (spec, spec_passes, *_) = drive(folder, 0, widths=widths), drive(folder, 4, widths=widths)
    assert spec == plain and sum(map(len, spec_passes.values())) < sum(map(len, plain_passes.values()))


def test_eos_ends_a_row_inside_an_accepted_run_where_it_would_have_without_drafts(make_tiny):
    folder = make_tiny("llama", "float32")
    tokens = drive(folder, 0).out["a"][0]
    eos = frozenset({next(t for t in tokens[12:] if t not in tokens[:12])})   # one row ends late, mid-run
    plain, spec = drive(folder, 0, eos=eos).out, drive(folder, 4, eos=eos).out
    assert spec == plain and plain["a"] == (tokens[:tokens.index(min(eos))], "stop")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_pools_take_drafts_and_give_the_same_tokens_in_fewer_passes(make_tiny, family, bits):
    folder, kv = make_tiny(family, "float32"), dict(kv_bits=bits, kv_group_size=32)
    plain, spec = drive(folder, 0, kv=kv), drive(folder, 4, kv=kv)
    assert spec.out == plain.out and all(len(t) == 24 and f == "length" for t, f in plain.out.values())
    assert spec.accepted["a"] > 0 and spec.accepted["b"] > 0
    assert sum(map(len, spec.passes.values())) < sum(map(len, plain.passes.values()))


# low temperatures and a top_k of 2: the tiny random model repeats itself, so lookup drafts get accepted
COOL = {"a": SamplingParams(temperature=0.05, seed=11), "b": SamplingParams(temperature=1.0, top_k=2, seed=12),
        "c": SamplingParams(temperature=0.1)}   # c unseeded: the streamer's seed for it


@pytest.mark.parametrize("speculate", [4, AUTO_DRAFTS])
def test_a_sampled_rows_text_depends_only_on_its_seed_whatever_lookup_drafted(make_tiny, speculate):
    folder = make_tiny("llama", "float32")
    runs = {k: drive(folder, k, sampling=COOL, speculate=speculate) for k in (0, 1, 2, 4)}
    assert all(run.out == runs[0].out for run in runs.values())
    assert all(f == "length" for _, f in runs[0].out.values())
    assert not any(runs[0].accepted.values()) and all(runs[k].accepted["a"] > 0 for k in (1, 2, 4))
    assert sum(map(len, runs[4].passes.values())) < sum(map(len, runs[0].passes.values()))
    again = drive(folder, 4, sampling=COOL, speculate=speculate)
    assert again.out == runs[4].out and again.accepted == runs[4].accepted


def test_sampled_rows_beside_a_greedy_row_are_each_decided_by_their_own_parameters_and_seed(make_tiny):
    folder = make_tiny("qwen2", "float32")
    sampling = {**COOL, "c": SamplingParams(temperature=0.7, top_p=0.6, seed=13)}
    prompts = {**PROMPTS, "g": PROMPTS["a"]}   # g greedy: a's prompt, as without speculation
    together = drive(folder, 4, sampling=sampling, speculate=4, prompts=prompts)
    assert together.out["g"] == drive(folder, 0, sampling={}, prompts={"g": prompts["g"]}).out["g"]
    assert together.accepted["a"] > 0 and together.accepted["b"] > 0
    for rid, params in sampling.items():   # alone without drafts, each token the draw of its seed from its logits
        alone = drive(folder, 0, sampling=sampling, speculate=4, keep_logits=True, prompts={rid: prompts[rid]})
        assert alone.out[rid] == together.out[rid], rid
        p = mx.softmax(target_logits(mx.array(np.stack(alone.logits[rid])), params), axis=-1)
        u = uniforms(params.seed, np.arange(p.shape[0]), 1)
        assert (np.array(mx.cumsum(p, axis=-1)) < u[:, None]).sum(axis=-1).tolist() == alone.out[rid][0], rid


def test_a_sampled_rows_text_on_quantized_pools_is_the_same_with_drafts_as_without(make_tiny):
    folder, kv = make_tiny("llama", "float32"), dict(kv_bits=8, kv_group_size=32)
    plain, spec = (drive(folder, k, sampling=COOL, speculate=4, kv=kv, keep_logits=True) for k in (0, 4))
    assert spec.out == plain.out and spec.accepted["a"] > 0 and not any(plain.accepted.values())
    for rid, logits in spec.logits.items():   # every token its own position's logits, drafted or not
        np.testing.assert_allclose(np.stack(logits), np.stack(plain.logits[rid]), atol=1e-4)


def test_the_actor_sends_each_rows_tokens_in_order_and_reports_the_drafts_accepted(make_tiny):
    from collections import Counter

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


def test_the_actors_reset_gives_the_jobs_speculate_to_its_sampled_rows(make_tiny):
    from spill import messages as m
    from spill.streamer.process import StreamerActor

    from .test_actor import plan
    folder, actor, runs = str(make_tiny("llama", "float32")), StreamerActor(), []
    for epoch, speculate in enumerate((4, 0, 4), 1):   # a new engine, then the same one reset twice
        actor.reset(m.Reset(epoch, folder, speculate=speculate))
        first = plan(0, [10], [PROMPTS["a"]], max_tokens=16, chunks=[(1, 16)])
        first.sampling = m.Sampling.of([COOL["a"]])
        out, stats, _ = actor.run(first)
        tokens, accepted = [], 0
        while True:
            tokens += np.frombuffer(out.tokens, np.int32).tolist()
            accepted += sum(n for _, n in stats.accepted)
            if actor.engine.idle:
                break
            out, stats, _ = actor.run(plan(len(runs), drafts=[[10, 4]]))
        runs.append((tokens, accepted))
    assert runs[0][1] > 0 and runs[1][1] == 0 and runs[2] == runs[0]


def test_a_streamed_pass_starts_its_reads_before_it_proposes_drafts(make_tiny, monkeypatch):
    """Prompt lookup and a draft model's steps run while the pass's first layers are read, not before the reads."""
    from spill.streamer import speculate
    from spill.streamer.reader import WeightReader
    seen = []
    start, propose, run = WeightReader.start_pass, speculate.proposals, Streamer.run
    monkeypatch.setattr(WeightReader, "start_pass", lambda self, *a, **kw: seen.append("read") or start(self, *a, **kw))
    monkeypatch.setattr(speculate, "proposals", lambda *a, **kw: seen.append("propose") or propose(*a, **kw))
    monkeypatch.setattr(Streamer, "run", lambda self, plan: seen.append("pass") or run(self, plan))
    drive(make_tiny("llama", "float32"), 4, max_tokens=6)
    passes = " ".join(seen).split("pass")
    drafting = [p.split() for p in passes if "propose" in p]
    assert drafting and all(p.index("read") < p.index("propose") for p in drafting)
