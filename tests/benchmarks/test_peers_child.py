"""What a peer's child process reports of its own memory: not its forking parent's."""

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
