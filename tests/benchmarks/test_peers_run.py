"""peers.py's capped runs: the GPU's memory while a child runs, and within spill's passes."""

import time

from tests.benchmarks.scripts import load

peers_run = load("peers_run")


def test_the_gpus_memory_in_spills_passes_is_apart_from_the_runs_start():
    # the first-use probe runs before the passes in a process of its own: its memory is not the job's
    samples = [(100.0, 900), (101.0, 1500), (102.0, 600), (104.0, 700), (106.0, 650), (108.0, 100)]
    passes = [{"time": 104.5, "seconds": 2.0}, {"time": 106.5, "seconds": 2.0}]
    assert peers_run.peak_within(samples, passes) == 700
    assert peers_run.peak_within(samples, []) is None and peers_run.peak_within([], passes) is None


def test_the_gpu_watch_keeps_its_samples_above_the_memory_in_use_before(monkeypatch):
    readings = iter([1000, 1300, 1800, 1200] + [1100] * 100)
    monkeypatch.setattr(peers_run, "gpu_used", lambda: next(readings))
    with peers_run.GpuWatch() as watch:
        time.sleep(0.9)
    assert watch.peak == 800 and [u for _, u in watch.samples][:3] == [300, 800, 200]
