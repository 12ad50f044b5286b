"""Several decode rounds in one pass of a resident pipeline: the tokens of as many one-step passes, on one rank
and across 2 and 3 ranks on the ring; a row that ends in a round rides the rest without passing its slot."""

import dataclasses
import json

import mlx.core as mx
import pytest

from spill.stages import launch, rounds
from spill.stages.relay import Relay
from spill.stages.staged import StagedStreamer
from spill.streamer.core import PassPlan, Row, Streamer
from spill.streamer.groups import Pool
from spill.streamer.sampling import SamplingParams

from .test_staged import _passes, _write, ring


def _plans(eos: int, steps=(3, 4, 2, 1, 5)) -> list[PassPlan]:
    """Rows starting over three passes (one sampled, one in a pool exactly as wide as its prompt and max_tokens,
    one ending on EOS), then passes of several rounds each (`steps`) until every row has ended."""
    a = Row("a", [5, 9, 13, 2, 7], 14, eos_ids=frozenset({eos}))
    b, c = Row("b", [30, 31], 14, width=256), Row(7, list(range(40, 90)), 12)
    d = Row("d", [3] * 17, 16, SamplingParams(temperature=0.8, seed=5), width=256)   # ends in the last round
    g = Row("g", list(range(20, 30)), 6, width=16)   # 10 + 6: its slot's last column is its last token's
    return [PassPlan([(a, 1), (b, 1), (c, 2)], {1: 64, 2: 32}),
            PassPlan([(d, 3), (g, 4)], {2: 32, 3: 64, 4: 64}, pools=[[8, 256], [4, 16]]),
            PassPlan(),
            *[PassPlan(rounds=n) for n in steps]]


def _one_step_each(plan_list) -> tuple[list[PassPlan], list[int]]:
    """The same plans with a pass of R rounds as R one-step passes, and how many passes each plan became."""
    out, counts = [], []
    for p in plan_list:
        out += [dataclasses.replace(p, rounds=1)] + [PassPlan() for _ in range(p.rounds - 1)]
        counts.append(p.rounds)
    return out, counts


def _merged(passes: list[dict], counts: list[int]) -> list[dict]:
    """One-step passes joined as the plans of several rounds ran them."""
    out, at = [], 0
    for n in counts:
        run = passes[at:at + n]
        out.append({k: [x for p in run for x in p[k]] for k in ("emitted", "left", "preempted")})
        at += n
    return out


def _expected(folder, eos: int) -> list[dict]:
    plans, counts = _one_step_each(_plans(eos))
    expected = _merged(_passes(reference := Streamer(folder), plans), counts)
    assert reference.idle   # every row ended within the plans
    return expected


def test_a_round_steps_each_live_row_one_column_never_past_its_slots_last():
    pool = Pool(4, 16, 1)
    pool.rows[:3], pool.lens[:3] = ["r0", None, "r2"], [7, 3, 15]
    pool.at = "stale"
    rounds.step(pool)
    assert pool.lens.tolist() == [8, 3, 15, 0] and pool.at is None


@pytest.mark.parametrize("m", [1, 3])
def test_a_resident_stage_of_one_rank_runs_rounds_with_the_tokens_of_as_many_passes(make_tiny, m):
    folder = make_tiny("llama", "float32", "256KB")
    free = _passes(Streamer(folder), _one_step_each(_plans(eos=-1))[0])
    eos = [t for p in free for row, t, _, _ in p["emitted"] if row == "a"][5]   # a's sixth token ends it, mid-round
    expected = _expected(folder, eos)
    finishes = {row: finish for p in expected for row, _, finish, _ in p["emitted"] if finish}
    assert finishes == {"a": "stop", "b": "length", 7: "length", "d": "length", "g": "length"}
    staged = StagedStreamer(folder, Relay(mx.distributed.init(strict=False), 10.0), resident=True, micro_batches=m)
    reports = [staged.run(p) for p in _plans(eos)]
    assert [r.rounds for r in reports] == [1, 1, 1, 3, 4, 2, 1, 5]
    got = [{"emitted": [[e.row_id, e.token, e.finish, e.position] for e in r.emitted], "left": r.left,
            "preempted": r.preempted} for r in reports]
    assert got == expected and staged.idle
    staged.close()


def test_a_streamed_stage_runs_one_step_whatever_the_plan_allows(make_tiny):
    folder = make_tiny("llama", "float32", "256KB")
    staged = StagedStreamer(folder, Relay(mx.distributed.init(strict=False), 10.0), micro_batches=2)
    assert [staged.run(p).rounds for p in _plans(eos=-1)] == [1] * 8
    staged.close()


@ring
def test_two_and_three_stages_run_rounds_with_the_single_process_tokens(make_tiny, tmp_path):
    folder = make_tiny("llama", "float32", "256KB")
    free = _passes(Streamer(folder), _one_step_each(_plans(eos=-1))[0])
    eos = [t for p in free for row, t, _, _ in p["emitted"] if row == "a"][5]
    expected = _expected(folder, eos)
    argv = ["-m", "spill.stages.serve", str(folder), "--plans", _write(_plans(eos), tmp_path / "plans.msgpack"),
            "--micro-batches", "3", "--resident"]
    runs = {n: launch.spawn(n, [*argv, "--out", str(tmp_path / f"passes{n}.json")]) for n in (2, 3)}
    for n, procs in runs.items():
        ranks = launch.wait(procs, timeout=240)
        assert all(rc == 0 for rc, _, _ in ranks), [err[-800:] for _, _, err in ranks]
        assert json.loads((tmp_path / f"passes{n}.json").read_text()) == [expected], f"{n} ranks"
        summaries = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in ranks]
        tokens = sum(len(p["emitted"]) for p in expected)
        assert [s["tokens"] for s in summaries] == [tokens] * n   # every stage took every row's tokens
        assert [s["passes"] for s in summaries] == [len(expected)] * n
