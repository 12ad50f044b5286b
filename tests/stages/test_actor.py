"""The streamer actor as stage 0 of a pipeline group: the tokens of the actor alone, message for message."""

import json
from pathlib import Path

import mlx.core as mx
import msgpack
import pytest

from spill import messages as m
from spill.stages import launch
from spill.streamer.process import StreamerActor

from .actor_rank import run

ring = pytest.mark.skipif(not mx.distributed.is_available("ring"), reason="this MLX build has no ring backend")


def _plan(epoch, index, rows=(), prompts=(), max_tokens=5, groups=None, chunks=(), **kw) -> m.Plan:
    tokens, lengths = m.pack_tokens(list(prompts))
    rows = list(rows)
    return m.Plan(epoch, rows, tokens, lengths, [max_tokens] * len(rows), m.Sampling.of([m.RowSampling()] * len(rows)),
                  [], index=index, widths=[0] * len(rows), groups=groups or [1] * len(rows),
                  chunks=[list(c) for c in chunks], **kw)


def _messages(model: str, other: str) -> list:
    """A job's plans; a reset that loads another model; one that keeps it but runs resident, its layers split by
    compute (loaded anew), and one that keeps both; each with plans of its own; a reset asking for drafts
    (refused by a group of several ranks)."""
    first = [_plan(1, 0, [10, 11, 12], [[5, 6, 7], [9, 10], list(range(40, 80))], groups=[1, 1, 2],
                   chunks=[(1, 3), (2, 16)]),
             _plan(1, 1, [13], [[3] * 9], groups=[3], chunks=[(2, 16), (3, 9)]),
             _plan(1, 2, chunks=[(2, 16)], drop=[13]),
             *[_plan(1, i) for i in range(3, 9)]]
    other_job = [_plan(2, 0, [30], [[11, 12, 13]], chunks=[(1, 3)]), *[_plan(2, i) for i in range(1, 6)]]
    again = [_plan(3, 0, [20, 21], [[7, 8], [1, 2, 3, 4]], chunks=[(1, 4)]), *[_plan(3, i) for i in range(1, 6)]]
    same = [_plan(4, 0, [40], [[9, 8, 7]], chunks=[(1, 3)]), *[_plan(4, i) for i in range(1, 4)]]
    return [m.Reset(1, model), *first, m.Reset(2, other), *other_job,
            m.Reset(3, other, resident=True, by_compute=True), *again,
            m.Reset(4, other, resident=True, by_compute=True), *same, m.Reset(5, model, speculate=2)]


@ring
def test_the_streamer_actor_drives_2_ranks_to_its_own_tokens_across_resets_and_models(make_tiny, tmp_path):
    model, other = (str(make_tiny("llama", "float32", "256KB", seed=s)) for s in (0, 1))
    frames = [m.encode(msg) for msg in _messages(model, other)]
    (tmp_path / "messages.msgpack").write_bytes(msgpack.packb(frames))
    script = str(Path(__file__).with_name("actor_rank.py"))
    procs = launch.spawn(2, [script, str(tmp_path / "messages.msgpack"), str(tmp_path / "out.json")])
    alone = run(StreamerActor(prefill_chunk=16), frames)
    ranks = launch.wait(procs, timeout=180)
    assert all(rc == 0 for rc, _, _ in ranks), [err[-800:] for _, _, err in ranks]
    staged = json.loads((tmp_path / "out.json").read_text())
    assert staged[:-1] == alone and len(alone) == 9 + 6 + 6 + 4   # every pass of the four jobs, token for token
    assert "--speculate 0" in staged[-1]["error"]
    assert sum(len(p["tokens"]) for p in alone) > 20
    # rank 1 ran every pass; last the second model's last layer: split by compute, its head weighs a layer and a third
    follower = json.loads(ranks[1][1].strip().splitlines()[-1])
    assert (follower["passes"], follower["layers"]) == (len(alone), [3, 4])


def test_stage_0_splits_the_layers_over_each_hosts_budget_and_loads_anew_when_they_change(monkeypatch):
    """The streamer opens its stage on the split admission prices (`split.host_capacity`): the followers' budgets
    as the job's RESET carries them, against its own."""
    from spill.streamer import process
    made = []

    class Stage:
        def __init__(self, model, relay, capacity=None, **kw):
            made.append(capacity)
            self.capacity = capacity

        def splits_as(self, by_compute, capacity=None):
            return capacity == self.capacity

        def __getattr__(self, name):   # clear, close, set_resident...: nothing to do here
            return lambda *a, **kw: None

    class Relay:
        size = 2

    monkeypatch.setattr(process, "StagedStreamer", Stage)
    actor = StreamerActor(relay=Relay(), budget=4 << 30)
    actor.reset(m.Reset(1, "model", hosts=[m.Host(16 << 30, 0.5)]))   # rank 1: twice rank 0's budget
    actor.reset(m.Reset(2, "model", hosts=[m.Host(16 << 30, 0.5)]))   # the same split: kept
    actor.reset(m.Reset(3, "model", hosts=[m.Host(8 << 30, 0.5)]))    # rank 0's budget: the even split, loaded anew
    assert made == [[4 << 30, 8 << 30], None]
