"""Replicas over 2 and 3 ranks on the ring: every rank the whole model, a share of the rows; the plans as admission
writes them give the single-process streamer's tokens, pass for pass, each row on one rank alone."""

import json

import mlx.core as mx

from spill.stages import launch, plans
from spill.stages.relay import Relay
from spill.stages.replicas import Replicas, share_of
from spill.streamer.core import PassPlan, Row, Streamer

from .test_staged import _passes, _plans, _write, ring


def _sorted(passes: list[dict]) -> list[dict]:
    """Each pass's tokens and rows in one order: replicas report rank by rank."""
    key = str
    return [{"emitted": sorted(p["emitted"], key=key), "left": sorted(p["left"], key=key),
             "preempted": sorted(p["preempted"], key=key)} for p in passes]


def test_a_replica_runs_its_own_rows_and_a_share_of_each_pools_slots():
    rows = [(Row(k, [1, 2], 4, width=256), 1) for k in "abc"]
    plan = PassPlan(rows, {1: 8}, drop=["x"], finish=["y"], pools=[[5, 256]], drafts={"z": 2})
    mine = share_of(plan, [1, 0, 1], 1, 2)
    assert [r.id for r, _ in mine.start] == ["a", "c"] and mine.pools == [[3, 256]]
    assert (mine.drop, mine.finish, mine.chunks, mine.drafts) == (["x"], ["y"], {1: 8}, {})
    op, (got, owners) = plans.unpack(plans.pack("share", (plan, [1, 0, 1])))
    assert op == "share" and owners == [1, 0, 1] and got.start == plan.start and got.pools == plan.pools


def test_a_replica_group_of_one_rank_is_the_whole_streamer_and_a_reset_frees_every_rows_rank(make_tiny):
    folder = make_tiny("llama", "float32", "256KB")
    replicas = Replicas(folder, Relay(mx.distributed.init(strict=False), 10.0))
    assert _passes(replicas, _plans(eos=3)[:2]) == _passes(Streamer(folder), _plans(eos=3)[:2])
    assert set(replicas.owners) == {"a", "b", 7, "e"} and {r for r, _ in replicas.owners.values()} == {0}
    replicas.clear()
    assert replicas.owners == {} and replicas.idle
    replicas.close()


@ring
def test_two_and_three_replicas_give_the_single_process_tokens_pass_for_pass(make_tiny, tmp_path):
    folder = make_tiny("llama", "float32", "256KB")
    free = _passes(Streamer(folder), _plans(eos=-1))
    eos = [t for p in free for row, t, _, _ in p["emitted"] if row == "a"][2]   # a's third token ends it
    expected = _sorted(_passes(Streamer(folder), _plans(eos)))
    argv = ["-m", "spill.stages.serve", str(folder), "--plans", _write(_plans(eos), tmp_path / "plans.msgpack"),
            "--replicas", "--resident"]
    runs = {n: launch.spawn(n, [*argv, "--out", str(tmp_path / f"passes{n}.json")]) for n in (2, 3)}
    for n, procs in runs.items():
        ranks = launch.wait(procs, timeout=240)
        assert all(rc == 0 for rc, _, _ in ranks), [err[-800:] for _, _, err in ranks]
        got = json.loads((tmp_path / f"passes{n}.json").read_text())
        assert [_sorted(run) for run in got] == [expected], f"{n} replicas"
        summaries = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in ranks]
        layers = summaries[0]["layers"]
        assert all(s["layers"] == layers == [0, layers[1]] for s in summaries)   # every rank the whole model
        tokens = [s["tokens"] for s in summaries]
        assert sum(tokens[1:]) > 0 and tokens[0] == sum(len(p["emitted"]) for p in expected)   # rank 0: every row's
        assert all(len(rows) == n - 1 for rows in summaries[0]["figures"])   # each pass: every follower's figures
