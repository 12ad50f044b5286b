"""End to end: an error a retry cannot fix ends the job at once with its sentence on the screen."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from .group_util import log_events, read_output, seed_home, write_input


@pytest.fixture
def own_home(tmp_path, llama_calibration):
    """A data home of this test's own: its logs are this group's alone."""
    home = tmp_path / "home"
    seed_home(home, llama_calibration)
    return home


def _run_until(args: list, env: dict, out, lines: int) -> subprocess.Popen:
    """`spill run ...` started, once `lines` rows of its output are written."""
    proc = subprocess.Popen([sys.executable, "-m", "spill.coordinator.cli", "run", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    deadline = time.monotonic() + 180
    while (not out.exists() or len(out.read_text().splitlines()) < lines) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    return proc


def test_a_shard_truncated_mid_job_fails_it_at_once_with_its_sentence(make_tiny, tmp_path, own_home):
    folder = tmp_path / "model"
    shutil.copytree(make_tiny("llama"), folder)
    write_input(tmp_path / "in.jsonl", 24)
    out = tmp_path / "out.jsonl"
    env = {"SPILL_HOME": str(own_home), "SPILL_MAX_ROWS": "4", "SPILL_TEST_PASS_DELAY": "0.1"}
    proc = _run_until([folder, tmp_path / "in.jsonl", "-o", out, "--stream", "--quiet"], env, out, lines=2)
    shard = folder / "model.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)   # as a download cut short, or a disk that lost its tail
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stdout + stderr
    assert stderr.startswith(f"spill: {shard}: expected model.layers."), stderr
    assert stderr.rstrip().endswith("it changed after the plan was made, re-download it"), stderr
    assert "Traceback" not in stderr and "crashed" not in stderr
    assert 2 <= len(read_output(out)) < 24
    events = log_events("coordinator", own_home)
    loads = [e for e in log_events("streamer", own_home) if e.get("event") == "ready"]
    assert len(loads) <= 2, "the model was loaded again and again"   # the first streamer, and the one replacing it
    assert [e["error"] for e in events if e.get("event") == "job failed"] == [stderr.strip().removeprefix("spill: ")]
