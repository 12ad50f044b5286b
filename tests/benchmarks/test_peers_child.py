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
    import time
    from tests.benchmarks.scripts import load
    peers_run = load("peers_run")
    readings = iter([100 << 20, 150 << 20, 300 << 20] + [120 << 20] * 1000)   # before, then while it runs
    monkeypatch.setattr(peers_run, "gpu_used", lambda: next(readings))
    with peers_run.GpuWatch() as watch:
        time.sleep(0.7)
    assert watch.peak == 200 << 20
    monkeypatch.setattr(peers_run, "gpu_used", lambda: None)   # no GPU: no figure, no thread
    with peers_run.GpuWatch() as watch:
        pass
    assert watch.peak is None


def _child():
    from tests.benchmarks.scripts import load
    return load("peers_child")


def test_rows_of_different_lengths_are_padded_on_the_left_and_counted_to_their_first_eos():
    child = _child()
    assert child.left_padded([[5, 6, 7], [8]], 0) == ([[5, 6, 7], [0, 0, 8]], [0, 2])
    assert child.to_eos([4, 2, 9, 2], [2]) == 2 and child.to_eos([4, 5], [2]) == 2
    steps = iter([[7, 2], [2, 3]])
    r = child.generate(lambda: [1, 2], lambda nxt, i: next(steps), 3, [2])
    assert (r["tokens"], r["generated"], r["to_eos"], len(r["steps"])) == ([1, 7, 2], 6, 3 + 1, 2)


def test_mlx_lm_gives_each_row_of_a_padded_batch_its_own_tokens(make_tiny, tmp_path):
    child = _child()
    folder = make_tiny("llama", dtype="float32")
    prompts = [[5, 9, 14, 3, 8, 21, 4], [7, 11], [30, 2, 6, 19]]
    base = {"model": str(folder), "new": 6, "eos": [], "pad": 0}
    together = [child.mlx_lm({**base, "prompts": prompts[k:] + prompts[:k]})["tokens"] for k in range(3)]
    alone = [child.mlx_lm({**base, "prompts": [p]})["tokens"] for p in prompts]
    assert together == alone
