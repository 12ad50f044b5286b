"""The supervisor's view of its actors from their beats, on a clock the test moves."""

from types import SimpleNamespace

import pytest

from spill.coordinator import supervisor


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(supervisor, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(supervisor, "learn_device", lambda: {"device": "cpu", "memory": 0})   # no child asks MLX
    return now


def test_an_actor_that_waited_long_for_work_is_wedged_only_once_busy_that_long(clock):
    """A group idle for fifteen minutes, then a job: the streamer loads its model (busy, its loop's count not
    moved yet). The deadline counts from when it became busy, not from when its count last moved."""
    sup = supervisor.Supervisor(None)
    sup.procs["streamer"] = SimpleNamespace(pid=7, poll=lambda: None)
    sup.beat("streamer", 7, progress=3, busy=False)
    clock[0] += 900
    sup.beat("streamer", 7, progress=3, busy=False)
    clock[0] += 1
    sup.beat("streamer", 7, progress=3, busy=True)
    assert sup.wedged(600) == []
    clock[0] += 599
    sup.beat("streamer", 7, progress=3, busy=True)
    assert sup.wedged(600) == []
    clock[0] += 2
    sup.beat("streamer", 7, progress=3, busy=True)
    assert sup.wedged(600) == ["streamer"]


def test_a_loop_that_comes_round_is_never_wedged(clock):
    sup = supervisor.Supervisor(None)
    sup.procs["tokenizer"] = SimpleNamespace(pid=8, poll=lambda: None)
    for count in range(20):
        sup.beat("tokenizer", 8, progress=count, busy=True)
        clock[0] += 100
        assert sup.wedged(600) == []
