"""Memory independent of job size: 50,000 rows through `spill run` with the coordinator,
tokenizer and admission each under 300 MB resident, sampled by pid during the run.

Minutes long on two cores (most of it the model's own prefill of 50,000 prompts), so CI skips it:
run it with `python -m pytest -m slow tests/coordinator/test_scale.py -s`."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spill.memory import process_memory

from .group_util import read_output

ROWS = 50_000
LIMIT = 300 * 2**20
ROLES = {"spill.coordinator.daemon": "coordinator", "spill.tokenizer_worker.process": "tokenizer",
         "spill.admission.process": "admission", "spill.streamer.process": "streamer"}


def group_pids(root_pid: int) -> dict[str, int]:
    """role -> pid of the spill processes under `root_pid`, found through /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        module = argv[2].decode() if len(argv) > 2 and argv[1] == b"-m" else ""
        if module in ROLES and _descends(int(entry.name), root_pid, stat):
            found[ROLES[module]] = int(entry.name)
    return found


def _descends(pid: int, root: int, stat: str) -> bool:
    for _ in range(4):
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        if parent == root:
            return True
        try:
            stat = Path(f"/proc/{parent}/stat").read_text()
        except OSError:
            return False
    return False


@pytest.mark.slow
def test_50000_rows_finish_with_bounded_memory(make_tiny, tmp_path):
    folder = make_tiny("llama")
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"Say {i}", "max_tokens": 1}) + "\n"
                           for i in range(ROWS)))
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "spill.coordinator.cli", "run", str(folder), str(inp),
                             "-o", str(tmp_path / "out.jsonl"), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak: dict[str, int] = {}
    while proc.poll() is None:
        for role, pid in group_pids(proc.pid).items():
            try:
                peak[role] = max(peak.get(role, 0), process_memory(pid).rss)
            except (OSError, StopIteration):
                pass   # it exited between the listing and the read
        time.sleep(0.5)
    seconds = time.monotonic() - started
    output = proc.stdout.read()
    assert proc.returncode == 0, output
    out = read_output(tmp_path / "out.jsonl")
    assert len(out) == ROWS and all(row["error"] is None for row in out.values())
    print(f"{ROWS} rows in {seconds:.0f} s; peak RSS MB:", {r: v // 2**20 for r, v in sorted(peak.items())})
    assert {"coordinator", "tokenizer", "admission"} <= set(peak)
    for role in ("coordinator", "tokenizer", "admission"):
        assert peak[role] < LIMIT, f"{role} reached {peak[role] / 2**20:.0f} MB"
