"""peers.py's own bookkeeping: a peer that failed keeps the setting it ran with; the GPU's memory by phase."""

import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks" / "peers.py")
peers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peers)


def test_accelerate_over_its_gpu_cap_keeps_the_share_it_ran_with(tmp_path, monkeypatch):
    # a child refused past the cap reports no share of its own: the table showed such a row unlabelled
    died = {"status": "failed", "rc": peers.OVER_CAP, "oom_kills": 0, "cgroup_peak": 1, "wall_s": 2.0, "stdout": "",
            "stages": [{"stage": "over-cap", "gpu_peak": 3 << 30}], "last_stage": "loaded"}
    monkeypatch.setattr(peers, "capped", lambda *a, **k: dict(died))
    r = peers.run_peer(SimpleNamespace(work=str(tmp_path)), "accelerate", 2, {"prompts": [[1], [2]], "hf_gpu_share": 0.5},
                       [])
    assert r["status"] == "over the GPU cap" and r["gpu_share"] == 0.5


def test_the_gpus_memory_in_spills_passes_is_apart_from_the_runs_start():
    # the first-use probe runs before the passes in a process of its own: its memory is not the job's
    samples = [(100.0, 900), (101.0, 1500), (102.0, 600), (104.0, 700), (106.0, 650), (108.0, 100)]
    passes = [{"time": 104.5, "seconds": 2.0}, {"time": 106.5, "seconds": 2.0}]
    assert peers.peak_within(samples, passes) == 700
    assert peers.peak_within(samples, []) is None and peers.peak_within([], passes) is None
    line = next(x for x in peers.table([{"time": "t", "machine": "m", "cap": 2**32, "gpu_cap": 2**32, "model": "llama",
                                          "model_bytes": 6e9, "prompt": 64, "new": 16, "cold_gbps_before": 2.0},
                                         {"peer": "spill", "batch": 8, "status": "ok", "s_per_step": 1.0,
                                          "decode_tps": 8.0, "gpu_used_peak": 1500 << 20, "gpu_used_passes": 700 << 20},
                                         {"run": "peers-end", "cold_gbps_after": 2.0}]) if x.startswith("| spill"))
    assert "| 1500 (700 in its passes) |" in line


def test_the_gpu_watch_keeps_its_samples_above_the_memory_in_use_before(monkeypatch):
    readings = iter([1000, 1300, 1800, 1200] + [1100] * 100)
    monkeypatch.setattr(peers, "gpu_used", lambda: next(readings))
    with peers.GpuWatch() as watch:
        time.sleep(0.9)
    assert watch.peak == 800 and [u for _, u in watch.samples][:3] == [300, 800, 200]


def test_spills_figures_come_from_its_passes_and_skip_the_written_records(tmp_path):
    """A job's history ends with a record of the rows written after its last pass (no pass fields): read by
    hand, it failed the run with KeyError 'prefill_tokens'."""
    from spill.coordinator import history
    lines = [{"prefill_tokens": 512, "decode_rows": 4, "seconds": 3.0, "emitted": 4, "bytes_streamed": 9, "done": 0},
             {"prefill_tokens": 0, "decode_rows": 4, "seconds": 1.0, "emitted": 4, "bytes_streamed": 9, "done": 0},
             {"prefill_tokens": 0, "decode_rows": 4, "seconds": 3.0, "emitted": 4, "bytes_streamed": 9, "done": 0},
             {"written": True, "time": 0.0, "done": 4}]
    (tmp_path / history.FILE).write_text("".join(f"{json.dumps(x)}\n" for x in lines))
    r = peers.decode_figures(history.read(tmp_path))
    assert (r["batch"], r["passes"], r["s_per_step"], r["decode_tps"]) == (4, 3, 2.0, 2.0)
