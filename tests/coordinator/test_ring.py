"""A pipeline group's ring as the supervisor keeps it, without processes: the ranks mlx.launch made, what a
streamer that lost a rank left behind, and the lines `spill status` shows."""

import json

from spill import messages as m
from spill.coordinator.ring import Ring
from spill.memory import describe


def _launched(tmp_path, n: int) -> dict:
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"10.0.0.{r + 1}:{5000 + r}"] for r in range(n)]))
    return {"MLX_RANK": "0", "MLX_HOSTFILE": str(hosts), "PATH": "/bin"}


def test_the_ring_mlx_launch_made_runs_once_then_rank_0_runs_alone(tmp_path, make_tiny):
    env = _launched(tmp_path, 3)
    ring = Ring(env=env)
    assert (ring.ranks, ring.size) == (3, 3)
    assert ring.start(dict(env, LANG="C.UTF-8")) == dict(env, LANG="C.UTF-8")   # the streamer is rank 0 of it
    assert ring.lines(str(make_tiny("llama")), 41) == [
        "stage 0: rank 0 on 10.0.0.1, layers 0-0 of 4, pid 41; no pass yet",
        "stage 1: rank 1 on 10.0.0.2, layers 1-2 of 4; no pass yet", "stage 2: rank 2 on 10.0.0.3, layers 3-3 of 4; no pass yet"]
    assert ring.start(env) == {"PATH": "/bin"}   # a streamer after a crash: its followers went with the last one
    assert ring.take() == ""                     # the crash tells the job, not the ring
    assert ring.lines(None, 42) == [
        "stage 0: rank 0 on 10.0.0.1, its layers split when a job names the model, pid 42",
        "stages 1-2: lost (its other ranks: they ended with the streamer that crashed); rank 0 holds every layer"]


def test_a_streamer_that_lost_a_rank_names_it_and_the_host(tmp_path):
    ring = Ring(env=_launched(tmp_path, 3))
    said = tmp_path / "lost-7.json"
    said.write_text(json.dumps({"rank": 2, "why": "the pipeline group lost a rank: waiting for tokens from rank 2 "
                                                  "(10.0.0.3:5002) took over 3 s; ..."}))
    assert ring.take(said) == ("the group lost rank 2 on 10.0.0.3 (it did not answer within SPILL_STAGE_TIMEOUT); "
                               "rank 0 goes on alone holding every layer, and the job's unfinished rows are computed "
                               "again")
    assert not said.exists() and ring.size == 1 and ring.take() == ""
    assert ring.lines(None, None)[-1] == ("stage 2: lost (rank 2 on 10.0.0.3: it did not answer within "
                                          "SPILL_STAGE_TIMEOUT); rank 0 holds every layer")


def test_a_group_of_one_rank_has_no_stages_and_no_ring(tmp_path):
    ring = Ring(1, env={"PATH": "/bin"})
    assert ring.start({"PATH": "/bin", "MLX_RANK": "0"}) == {"PATH": "/bin"} and ring.lines(None, 5) == []


def test_the_status_lines_show_the_layers_as_the_running_job_splits_them(tmp_path, make_tiny):
    ring, folder = Ring(env=_launched(tmp_path, 2)), str(make_tiny("llama"))
    assert [line.split("; ")[0] for line in ring.lines(folder, 7)] == [
        "stage 0: rank 0 on 10.0.0.1, layers 0-1 of 4, pid 7", "stage 1: rank 1 on 10.0.0.2, layers 2-3 of 4"]
    # resident, split by compute: the head on stage 1 weighs a layer and a third
    assert [line.split("; ")[0] for line in ring.lines(folder, 7, by_compute=True)] == [
        "stage 0: rank 0 on 10.0.0.1, layers 0-2 of 4, pid 7", "stage 1: rank 1 on 10.0.0.2, layers 3-3 of 4"]


def test_each_stage_line_says_its_working_set_its_own_budget_and_its_pass_time(tmp_path):
    ring = Ring(env=_launched(tmp_path, 3))
    ring.start({"PATH": "/bin"})
    own = describe({"memory": 8 * 2**30, "budget_fraction": 0.5})   # rank 0's group: a 4 GiB budget
    ring.ready([m.Host(2 * 2**30, 0.75, 0.0005, 2**30)])   # rank 1 told its own and its link; rank 2 none (rank 0's)
    assert [line.split("; ", 1)[1] for line in ring.lines(None, 9, own=own)] == [
        "budget 4.0 GiB, no pass yet", "budget 1.5 GiB, link from rank 0 0.5 ms and 1.0 GiB/s, no pass yet",
        "budget 4.0 GiB (rank 0's), no pass yet"]
    for seconds in (0.5, 0.25, 0.75, 1.0):   # rank 0's pass, then rank 1's of the pass before (rank 2's came late)
        ring.observe([m.StagePass(3 * 2**30, 2**29, seconds, 0.25, 0.125), m.StagePass(2**30, 2**28, 2 * seconds, 1, 0)])
    assert ring.lines(None, 9, own=own)[:2] == [
        "stage 0: rank 0 on 10.0.0.1, its layers split when a job names the model, pid 9; working set 3.5 GiB "
        "(weights 3.0 GiB, KV 512.0 MiB), budget 4.0 GiB; pass 1 s (compute 0.25 s, blocked on a neighbour 0.125 s), "
        "median 0.625 s of the last 4",
        "stage 1: rank 1 on 10.0.0.2, its layers split when a job names the model; working set 1.2 GiB (weights "
        "1.0 GiB, KV 256.0 MiB), budget 1.5 GiB, link from rank 0 0.5 ms and 1.0 GiB/s; pass 2 s (compute 1 s, blocked on a neighbour 0 s), median 1.25 s of "
        "the last 4"]
    ring.start({"PATH": "/bin"})   # the streamer starts again (here alone): a new streamer tells them anew
    assert (ring.memories, ring.passes) == ([], [])
    assert ring.lines(None, 10, own=own)[0] == ("stage 0: rank 0 on 10.0.0.1, its layers split when a job names the "
                                                "model, pid 10")


def test_the_status_lines_split_the_layers_over_each_hosts_budget_as_the_streamer_does(tmp_path, make_tiny):
    ring, folder = Ring(env=_launched(tmp_path, 2)), str(make_tiny("llama"))
    ring.start({"PATH": "/bin"})
    own = describe({"memory": 8 * 2**30, "budget_fraction": 0.5})
    ring.ready([m.Host(80 * 2**30, 0.5)])   # rank 1's host: ten times rank 0's budget, so most of the layers
    assert [line.split("; ")[0] for line in ring.lines(folder, 7, own=own)] == [
        "stage 0: rank 0 on 10.0.0.1, layers 0-0 of 4, pid 7", "stage 1: rank 1 on 10.0.0.2, layers 1-3 of 4"]
    ring.ready([m.Host(8 * 2**30, 0.5)])    # the same budget as rank 0's: the even split
    assert [line.split("; ")[0] for line in ring.lines(folder, 7, own=own)] == [
        "stage 0: rank 0 on 10.0.0.1, layers 0-1 of 4, pid 7", "stage 1: rank 1 on 10.0.0.2, layers 2-3 of 4"]
