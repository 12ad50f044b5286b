"""What each follower tells rank 0 (stages/figures.py): its memory at join, as its own arguments found it, and each
pass's working set and times, a pass behind and exactly as the follower measured them."""

import json

import mlx.core as mx
import pytest

from spill.stages import figures, launch
from spill.stages.relay import Relay
from spill.stages.split import stage_shares
from spill.stages.staged import StagedStreamer
from spill.streamer.core import PassPlan, Row, Streamer
from spill.streamer.plan import load_plan

from .test_staged import _plans, _write, ring

# rank r runs serve with --memory {r}GB (rank 0 takes none: its group's arguments are its own)
BY_RANK = ("import os, sys; from spill.stages import serve; r = int(os.environ['MLX_RANK']); "
           "sys.exit(serve.main(sys.argv[1:] + (['--memory', f'{r}GB'] if r else [])))")


def test_a_streamer_holds_its_resident_tensors_its_layers_in_flight_or_kept_and_its_rows_kv(make_tiny):
    folder = make_tiny("llama", "float32", "256KB")
    plan, rows = load_plan(folder), [Row("a", [5, 9, 13], 4, width=256), Row("b", [7, 8], 4, width=256)]
    around = sum(t.nbytes for t in plan.resident)
    streamed, resident = Streamer(folder), Streamer(folder, resident=True)
    assert figures.held(streamed) == (around + streamed.reader.slot_bytes, 0)
    for s in (streamed, resident):
        s.run(PassPlan([(r, 1) for r in rows], {1: 8}, pools=[[2, 256]]))
        s.run(PassPlan())   # the rows decode in their pool: 2 slots of 256 columns, a K and a V a layer
    heads, dim = plan.kv_heads_and_dim
    kv = 2 * len(plan.layers) * 2 * heads * 256 * dim * 4
    assert figures.held(streamed) == (around + streamed.reader.slot_bytes, kv)
    assert figures.held(resident) == (around + sum(plan.layer_bytes(i) for i in range(len(plan.layers))), kv)
    assert figures.pass_of(figures.own_pass(resident, resident.run(PassPlan())))["kv"] == kv
    streamed.close()
    resident.close()


def test_a_group_of_one_rank_gathers_nothing(make_tiny):
    staged = StagedStreamer(make_tiny("llama", "float32", "256KB"), Relay(mx.distributed.init(strict=False), 10.0))
    staged.run(_plans(eos=3)[0])
    assert staged.followers == [] and staged.relay.hosts == []
    staged.close()


@ring
def test_each_follower_tells_rank_0_its_own_budget_at_join_and_its_figures_a_pass_behind(make_tiny, tmp_path):
    folder = make_tiny("llama", "float32", "256KB")
    plan_list = _plans(eos=-1)
    argv = ["-c", BY_RANK, str(folder), "--plans", _write(plan_list, tmp_path / "plans.msgpack"),
            "--budget-fraction", "0.5"]
    ranks = launch.wait(launch.spawn(3, argv), timeout=240)
    assert all(rc == 0 for rc, _, _ in ranks), [err[-800:] for _, _, err in ranks]
    first, *followers = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in ranks]
    assert [h[:2] for h in first["hosts"]] == [[1e9, 0.5], [2e9, 0.5]]   # each its own --memory, rank 1 first
    for latency, bandwidth in (h[2:] for h in first["hosts"]):   # and the link into it, timed at join
        assert 0 < latency < 0.1 and bandwidth > 1e6
    told, reference = first["figures"], Streamer(folder)
    idle = [(reference.run(p), reference.idle)[1] for p in _plans(eos=-1)]   # passes that leave no row running
    assert len(told) == len(plan_list) and told[0] == [] and idle[-1] and not idle[0]   # the first's come later
    shares = stage_shares(load_plan(folder), 3)
    for k in range(1, len(plan_list)):
        for f, (rank, share) in zip(told[k], enumerate(shares[1:], 1)):   # a pass behind, or its own where idle
            got, own = figures.pass_of(f), followers[rank - 1]["timing"][k if idle[k] else k - 1]
            assert [got["seconds"], got["compute_s"], got["link_s"]] == pytest.approx(own, abs=1e-6)
            assert got["weights"] >= share.resident_bytes and got["kv"] >= 0
    assert any(figures.pass_of(f)["kv"] > 0 for f in told[1])   # the rows of the first pass hold KV on every rank


def test_a_follower_given_a_budget_fraction_out_of_range_says_so(capsys):
    from spill.stages import serve
    assert serve.main(["--budget-fraction", "1.5"]) == 2
    assert "rank error: --budget-fraction must be above 0 and at most 1" in capsys.readouterr().err
