"""peers.py's own bookkeeping: a peer that failed keeps the setting it ran with."""

import importlib.util
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
