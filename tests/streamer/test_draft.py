"""Drafts from a resident draft model (--draft): greedy rows give the tokens they give without drafts, over
unquantized or quantized KV, every draft accepted where the draft is the target itself and few where it is another
model; a sampled row's seeded text is the same at any bound; `spill check --draft` gates identity and refuses a draft
with another vocabulary."""

import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
from typer.testing import CliRunner

from spill.coordinator.cli import app
from spill.streamer.core import PassPlan, Row, Streamer
from spill.streamer.sampling import SamplingParams

from .test_speculate import PROMPTS

COOL = {"a": SamplingParams(temperature=0.3, seed=11), "b": SamplingParams(temperature=1.0, top_k=3, seed=12),
        "c": SamplingParams(temperature=0.7, top_p=0.8, seed=13)}


class Run(NamedTuple):
    out: dict        # row -> its tokens
    passes: int
    drafted: int
    accepted: int


def drive(folder, k: int, draft=None, sampling=None, speculate: int = 0, max_tokens: int = 20, kv=None) -> Run:
    """Every row started in one pass, then decode passes with up to k drafts a row (from `draft` where given)."""
    s = Streamer(folder, dtype=None, speculate=speculate, draft=str(draft) if draft else None, **(kv or {}))
    sampling = sampling or {}
    rows = [Row(rid, p, max_tokens, sampling.get(rid, SamplingParams())) for rid, p in PROMPTS.items()]
    out, drafted, accepted = {r.id: [] for r in rows}, 0, 0
    plan = PassPlan(start=[(r, 1) for r in rows], chunks={1: 64})
    while True:
        report = s.run(plan)
        for e in report.emitted:
            out[e.row_id].append(e.token)
        drafted, accepted = drafted + sum(report.drafted.values()), accepted + sum(report.accepted.values())
        if s.idle:
            return Run(out, s.passes, drafted, accepted)
        plan = PassPlan(drafts={rid: k for rid in PROMPTS})


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])   # gemma3: sliding-window caches, a row at a time
def test_the_target_as_its_own_draft_has_every_draft_accepted_and_the_same_tokens(make_tiny, family):
    folder = make_tiny(family, "float32")
    plain, spec = drive(folder, 0), drive(folder, 4, draft=folder)
    assert spec.out == plain.out and all(len(t) == 20 for t in spec.out.values())
    assert spec.accepted == spec.drafted > 0 and spec.passes < plain.passes


def test_a_draft_of_other_weights_has_few_drafts_accepted_and_the_same_tokens(make_tiny):
    folder, other = make_tiny("llama", "float32"), make_tiny("llama", "float32", seed=1)
    plain, spec = drive(folder, 0), drive(folder, 4, draft=other)
    assert spec.out == plain.out
    assert spec.drafted > 0 and spec.accepted < spec.drafted / 2


def test_the_draft_models_cache_moves_back_to_what_the_row_kept(make_tiny):
    from spill.streamer.draft import DraftModel
    from spill.streamer.groups import RowState
    from spill.streamer.sampling import RowSampler
    other = make_tiny("llama", "float32", seed=1)
    row, kept = RowState(Row("a", PROMPTS["a"], 40), RowSampler(SamplingParams(), 0)), DraftModel(other, None, None)
    row.tokens = [3]
    first = kept.propose([(row, 4)], {"a"})[id(row)]
    row.tokens += [first[0], (first[1] + 1) % 2048, 7]   # the row kept one draft, then took tokens of its own
    again = kept.propose([(row, 4)], {"a"})[id(row)]
    assert again == DraftModel(other, None, None).propose([(row, 4)], {"a"})[id(row)]   # a cache made anew
    assert kept.caches["a"][0][0].offset == len(PROMPTS["a"]) + len(row.tokens) + 3   # its 4th draft never fed
    assert kept.propose([], set()) == {} and kept.caches == {}   # a row gone: its cache too
    rows = [RowState(Row(rid, PROMPTS[rid], 40), RowSampler(SamplingParams(), 0)) for rid in ("a", "b")]
    for r in rows:
        r.tokens = [3]
    together = kept.propose([(rows[0], 4), (rows[1], 2)], {"a", "b"})   # one batch: rows of unequal lengths
    assert [len(together[id(r)]) for r in rows] == [4, 2]
    rows[0].tokens += together[id(rows[0])][:2] + [9]   # a keeps two drafts, b none
    rows[1].tokens += [11]
    together = kept.propose([(r, 4) for r in rows], {"a", "b"})
    assert [together[id(r)] for r in rows] == [DraftModel(other, None, None).propose([(r, 4)], {r.row.id})[id(r)]
                                               for r in rows]


def test_a_sampled_rows_seeded_text_is_the_same_at_any_bound_with_a_draft(make_tiny):
    folder, other = make_tiny("qwen2", "float32"), make_tiny("qwen2", "float32", seed=1)
    runs = {k: drive(folder, k, draft=folder, sampling=COOL, speculate=4) for k in (0, 1, 4)}
    assert runs[1].out == runs[0].out and runs[4].out == runs[0].out
    assert runs[4].accepted == runs[4].drafted > 0   # the target's own distribution: its draws coincide
    assert drive(folder, 4, draft=other, sampling=COOL, speculate=4).out == runs[0].out


def _other_vocabulary(folder: Path, tmp_path: Path) -> Path:
    """The model's folder with another family's real tokenizer (32768 tokens): a draft that cannot serve it."""
    out = tmp_path / "other"
    shutil.copytree(folder, out)
    shutil.copy(Path(__file__).parents[1] / "data" / "mistral-v0.3" / "tokenizer.json", out / "tokenizer.json")
    return out


def test_check_with_a_draft_gates_identity_and_refuses_another_vocabulary(make_tiny, tmp_path):
    folder = make_tiny("llama", "float32")
    said = CliRunner().invoke(app, ["check", str(folder), "--rows", "2", "--max-tokens", "12", "--prefill-chunk",
                                    "16", "--speculate", "4", "--draft", str(folder)])
    assert said.exit_code == 0, said.output
    assert f"drafts: up to 4 a pass from the draft model {folder} on the free-running rows" in said.output
    other = _other_vocabulary(folder, tmp_path)
    said = CliRunner().invoke(app, ["check", str(folder), "--speculate", "4", "--draft", str(other)])
    assert said.exit_code == 2 and said.output.strip() == (
        f"spill: --draft {other}: its vocabulary (32768 tokens) differs from the model's (2048 tokens); give --draft "
        "a smaller model that shares the model's tokenizer (the same family), or leave --draft out")


def test_a_draft_beside_quantized_pools_keeps_its_own_cache_and_gives_the_same_tokens(make_tiny):
    """The target's pools quantized, the draft model's cache its own (unquantized): the tokens the rows give without
    drafts at that KV format, in fewer passes; `spill check` gates it against mlx-lm's quantized cache."""
    folder, kv = make_tiny("llama", "float32"), dict(kv_bits=4, kv_group_size=32)
    plain, spec = drive(folder, 0, kv=kv), drive(folder, 4, draft=folder, kv=kv)
    assert spec.out == plain.out and spec.accepted > 0 and spec.passes < plain.passes
    said = CliRunner().invoke(app, ["check", str(folder), "--rows", "2", "--max-tokens", "12", "--prefill-chunk", "16",
                                    "--speculate", "4", "--draft", str(folder), "--kv-bits", "8",
                                    "--kv-group-size", "32"])
    assert said.exit_code == 0, said.output
    assert f"drafts: up to 4 a pass from the draft model {folder} on the free-running rows" in said.output


def test_the_actors_reset_loads_the_jobs_draft_model_and_drops_it(make_tiny):
    from spill import messages as m
    from spill.streamer.process import StreamerActor
    folder, actor = str(make_tiny("llama", "float32")), StreamerActor()
    actor.reset(m.decode(m.encode(m.Reset(1, folder, speculate=4, draft=folder))))   # as it crosses the wire
    assert actor.engine.draft.folder == folder
    actor.reset(m.Reset(2, folder, speculate=4))   # the next job's: prompt lookup
    assert actor.engine.draft is None
