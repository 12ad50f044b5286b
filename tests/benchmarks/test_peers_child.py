"""What a peer's child process reports of its own memory (not its forking parent's), and the GPU memory a peer held."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_peers_peak_rss_is_its_own_not_the_parent_it_was_forked_from():
    held = bytearray(400 << 20)
    for i in range(0, len(held), 4096):   # touched: resident in this process when the child forks
        held[i] = 1
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); from peers_child import peak_rss; print(peak_rss())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) < 200 << 20   # ru_maxrss said 400 MiB and more: it outlives exec


def test_the_gpu_in_use_is_its_most_while_the_child_ran_above_what_was_in_use_before(monkeypatch):
    import importlib.util
    import time
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))   # peers.py imports its neighbours
    spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks" / "peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    readings = iter([100 << 20, 150 << 20, 300 << 20] + [120 << 20] * 1000)   # before, then while it runs
    monkeypatch.setattr(peers, "gpu_used", lambda: next(readings))
    with peers.GpuWatch() as watch:
        time.sleep(0.7)
    assert watch.peak == 200 << 20
    monkeypatch.setattr(peers, "gpu_used", lambda: None)   # no GPU: no figure, no thread
    with peers.GpuWatch() as watch:
        pass
    assert watch.peak is None
