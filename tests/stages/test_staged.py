"""The streamer core split over 2 and 3 ranks on the ring, running plans as admission writes them: the
single-process streamer's tokens, pass for pass; a lost rank an error on rank 0, never a hang."""

import json

import mlx.core as mx
import msgpack
import pytest

from spill.errors import SpillError
from spill.stages import launch, micro, plans
from spill.stages.relay import Relay
from spill.stages.split import stage_shares
from spill.stages.staged import StagedStreamer
from spill.streamer.core import PassPlan, Row, Streamer
from spill.streamer.groups import Pool
from spill.streamer.plan import load_plan
from spill.streamer.sampling import SamplingParams

ring = pytest.mark.skipif(not mx.distributed.is_available("ring"), reason="this MLX build has no ring backend")


def _plans(eos: int) -> list[PassPlan]:
    """Rows starting in different passes; a 50-token prompt prefilled 16 columns a pass; rows ending on EOS
    (a, at `eos`), on max_tokens, and by a stop string (f); a row dropped while it prefills (e); a sampled
    row (d); rows in two decode pools (b and d reserve width 256); then empty passes until every row has left."""
    a = Row("a", [5, 9, 13, 2, 7], 8, eos_ids=frozenset({eos}))
    b, c = Row("b", [30, 31], 5, width=256), Row(7, list(range(40, 90)), 6)   # c: an int id, like a job's row numbers
    d = Row("d", [3] * 17, 6, SamplingParams(temperature=0.8, seed=5), width=256)
    e, f = Row("e", [11, 12, 13, 14, 15, 16, 17], 6), Row("f", [100, 200, 300], 9)
    return [PassPlan([(a, 1), (b, 1), (c, 2)], {1: 64, 2: 16}),
            PassPlan([(e, 3)], {2: 16, 3: 2}),
            PassPlan([(d, 4), (f, 5)], {2: 16, 3: 2, 4: 64, 5: 64}),
            PassPlan([], {2: 16}, drop=["e"]),
            PassPlan(),
            PassPlan(finish=["f"]),
            *[PassPlan() for _ in range(6)]]


def _passes(streamer, plan_list) -> list[dict]:
    """Each pass's tokens (row, token, finish, position), rows that left and rows preempted, as serve.py writes them."""
    out = []
    for plan in plan_list:
        r = streamer.run(plan)
        out.append({"emitted": [[e.row_id, e.token, e.finish, e.position] for e in r.emitted],
                    "left": r.left, "preempted": r.preempted})
    return out


def _write(plan_list, path) -> str:
    path.write_bytes(msgpack.packb([plans.pack("plan", p) for p in plan_list]))
    return str(path)


def test_a_plan_crosses_to_the_other_ranks_as_it_was_written():
    plan = _plans(eos=3)[2]
    plan.start[0][0].teacher = (4, 5)
    plan.pools = [[8, 256]]
    op, got = plans.unpack(plans.pack("plan", plan))
    assert op == "plan" and got == plan
    assert plans.unpack(plans.pack("kv", [8, 64])) == ("kv", [8, 64])
    with pytest.raises(SpillError, match="every host of the group must run the same spill version"):
        plans.unpack(msgpack.packb(["plan", {"ids": [1]}]))


def test_a_stage_of_one_rank_is_the_whole_streamer_and_refuses_drafts(make_tiny):
    folder = make_tiny("llama", "float32", "256KB")
    relay = Relay(mx.distributed.init(strict=False), 10.0)
    with pytest.raises(SpillError, match="--speculate 0"):
        StagedStreamer(folder, relay, speculate=2)
    staged = StagedStreamer(folder, relay)
    assert _passes(staged, _plans(eos=3)) == _passes(Streamer(folder), _plans(eos=3))
    with pytest.raises(SpillError, match="PassPlan.finish"):
        staged.finish("a")
    staged.close()


def test_the_decode_rows_cut_into_micro_batches_in_their_joint_order_across_pools():
    pools = [Pool(8, 256, 1), Pool(4, 512, 1)]
    pools[0].rows[:3], pools[1].rows[:2] = ["r0", "r1", "r2"], ["s0", "s1"]
    cut = lambda m: [[(p.rows, p.lo) for p in d.pools] for d in micro.split(pools, m, 1)]
    assert cut(2) == [[(["r0", "r1"], 0)], [(["r2"], 2), (["s0", "s1"], 0)]]
    assert cut(9) == [[([r], lo)] for lo, r in enumerate(["r0", "r1", "r2"])] + [[([r], lo)] for lo, r in enumerate(["s0", "s1"])]
    assert [d.pools for d in micro.split(pools, 1, 1)] == [pools] and micro.split([], 3, 1) == []


@pytest.mark.parametrize("m", [2, 3])
def test_a_resident_stage_of_one_rank_runs_micro_batches_with_the_whole_streamers_tokens(make_tiny, m):
    folder = make_tiny("llama", "float32", "256KB")
    staged = StagedStreamer(folder, Relay(mx.distributed.init(strict=False), 10.0), resident=True, micro_batches=m)
    plan_list = _plans(eos=3)
    first = _passes(staged, plan_list[:1])
    assert staged._micro   # its first pass too: micro-batch 0 reads each layer, the others find it kept
    assert first + _passes(staged, plan_list[1:]) == _passes(Streamer(folder), _plans(eos=3))
    staged.close()


@ring
@pytest.mark.parametrize("resident", [False, True], ids=["streamed", "resident"])
def test_two_and_three_stages_give_the_single_process_tokens_pass_for_pass(make_tiny, tmp_path, resident):
    """With 1 to 4 micro-batches a pass (a resident stage runs them micro-batch outer, its first pass too)."""
    folder = make_tiny("llama", "float32", "256KB")
    free = _passes(Streamer(folder), _plans(eos=-1))
    eos = [t for p in free for row, t, _, _ in p["emitted"] if row == "a"][2]   # a's third token ends it
    expected = _passes(reference := Streamer(folder), _plans(eos))
    assert reference.idle and not expected[-1]["emitted"]   # the plans ran every row to its end
    finishes = {row: finish for p in expected for row, _, finish, _ in p["emitted"] if finish}
    assert finishes == {"a": "stop", "b": "length", 7: "length", "d": "length"}
    assert expected[3]["preempted"] == ["e"] and "f" in expected[5]["left"]   # dropped; ended by a stop string
    argv = ["-m", "spill.stages.serve", str(folder), "--plans", _write(_plans(eos), tmp_path / "plans.msgpack"),
            "--micro-batches", "1,2,3,4", *(["--resident"] if resident else [])]
    runs = {n: launch.spawn(n, [*argv, "--out", str(tmp_path / f"passes{n}.json")]) for n in (2, 3)}
    for n, procs in runs.items():
        ranks = launch.wait(procs, timeout=240)
        assert all(rc == 0 for rc, _, _ in ranks), [err[-800:] for _, _, err in ranks]
        assert json.loads((tmp_path / f"passes{n}.json").read_text()) == [expected] * 4, f"{n} ranks"
        summaries = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in ranks]
        shares = stage_shares(load_plan(folder), n, by_compute=resident)
        for s, share in zip(summaries, shares):   # every rank ran every pass; each read its own share only
            assert s["passes"] == 4 * len(expected) and s["tokens"] == summaries[0]["tokens"]
            assert s["layers"] == [share.layers.start, share.layers.stop]
            assert set(s["read"]) == {share.layer_bytes, 0} and s["resident_bytes"] == share.resident_bytes
            assert all(wall >= compute and waited >= 0 for wall, compute, waited in s["timing"])


@ring
@pytest.mark.parametrize("n,fault,why,more", [(3, "pass:3", "a rank died", ["--resident", "--micro-batches", "3"]),
                                              (2, "pass:3:wedge", "took over 3 s", [])])
def test_a_rank_lost_mid_run_fails_rank_0_with_an_error_naming_it(make_tiny, tmp_path, n, fault, why, more):
    """Rank 1 killed (or its loop stopped) at its third pass: rank 0 says the group lost a rank, at once where
    the ring saw it die (micro-batched: its sends in flight), after --deadline where it stopped answering; the
    group's recovery starts from this."""
    folder = make_tiny("llama", "float32", "256KB")
    argv = ["-m", "spill.stages.serve", str(folder), "--plans", _write(_plans(eos=-1), tmp_path / "plans.msgpack"),
            "--deadline", "3", *more]
    ranks = launch.wait(launch.spawn(n, argv, rank_env={1: {"SPILL_TEST_CRASH_STREAMER": fault}}), timeout=120)
    rc, _, err = ranks[0]
    assert rc == 2, err[-800:]
    assert "rank error: the pipeline group lost a rank" in err and why in err
