"""Joining the ring, and ranks on loopback."""

import json

from spill.stages import launch
from spill.stages.link import Link, join, measure


def test_a_process_not_launched_is_a_group_of_one_with_no_hop(monkeypatch):
    monkeypatch.delenv("MLX_RANK", raising=False)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    group = join()
    assert (group.size(), group.rank()) == (1, 0)
    assert measure(group) == []


def test_a_hop_is_priced_by_its_latency_and_bandwidth():
    assert Link(latency_s=1e-4, bandwidth=1e9).seconds(10**6) == 1e-4 + 1e-3


def test_a_failed_rank_ends_the_others_instead_of_leaving_them_waiting():
    code = "import os, sys, time; r = int(os.environ['MLX_RANK']); sys.exit(3) if r == 0 else time.sleep(60)"
    ranks = launch.run(2, ["-c", code], timeout=30)
    assert [rc for rc, _, _ in ranks] == [3, -9]
    assert "another rank failed" in ranks[1][2]


def test_ranks_get_distinct_free_ports_in_one_hostfile(tmp_path):
    hosts = json.loads(launch.hostfile(3, tmp_path).read_text())
    assert len(hosts) == 3 and len({h[0] for h in hosts}) == 3 and all(h[0].startswith("127.0.0.1:") for h in hosts)
