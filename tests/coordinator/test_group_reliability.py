"""End to end: an error a retry cannot fix ends the job at once with its sentence on the screen."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from .group_util import llama_job, log_events, read_output, seed_home, spill, texts, write_input


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
    env = {"SPILL_HOME": str(own_home), "SPILL_MAX_ROWS": "4", "SPILL_TEST_PASS_DELAY": "0.1",
           "SPILL_METRICS_PORT": "0"}   # another group on this machine may hold the port: its warning is not the point
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


@pytest.fixture(scope="module")
def job12(make_tiny, tmp_path_factory):
    return llama_job(make_tiny, tmp_path_factory, 12, max_tokens=6)


def test_rows_whose_submit_was_lost_are_submitted_again(job12, tmp_path, own_home):
    """ZeroMQ drops a frame over the cap without a word: the rows stayed in flight for ever. Every actor idle with
    rows out, the coordinator submits them again."""
    folder, inp, expected = job12
    out = tmp_path / "out.jsonl"
    spill("run", folder, inp, "-o", out, "--quiet", check=True, timeout=240,
          env={"SPILL_HOME": str(own_home), "SPILL_TEST_DROP": "SUBMIT:1", "SPILL_STALL_TIMEOUT": "3"})
    assert texts(read_output(out)) == expected
    assert [e["event"] for e in log_events("coordinator", own_home) if "idle" in e.get("event", "")] == [
        "rows outstanding while every actor is idle; submitting them again"]


def test_rows_larger_together_than_a_frame_go_in_several_submits(job12, tmp_path, own_home):
    """The rows' requests, a 24 KB stop string each, are 288 KB together against a 256 KB frame cap."""
    folder, inp, expected = job12
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({**json.loads(line), "stop": ["\u00a7" + "z" * 24_000]}) + "\n"
                           for line in inp.read_text().splitlines()))
    out = tmp_path / "out.jsonl"
    spill("run", folder, big, "-o", out, "--quiet", check=True, timeout=240,
          env={"SPILL_HOME": str(own_home), "SPILL_MAX_MESSAGE_MB": "0.25", "SPILL_MAX_ROWS": "4"})
    assert texts(read_output(out)) == expected


WEDGE_S = "10"   # twice a tokenizer's load on a busy machine (5 s at load 10), which is work, not a wedge


@pytest.mark.parametrize("actor, event", [("tokenizer", "tokens:2"), ("admission", "pass:3"), ("streamer", "pass:3")])
def test_an_actor_whose_loop_is_wedged_is_restarted_and_the_job_finishes(job12, tmp_path, own_home, actor, event):
    """Its heartbeat thread still beats: only the loop's progress, which stopped, shows the deadlock."""
    folder, inp, expected = job12
    out = tmp_path / "out.jsonl"
    spill("run", folder, inp, "-o", out, "--quiet", check=True, timeout=600,
          env={"SPILL_HOME": str(own_home), f"SPILL_TEST_CRASH_{actor.upper()}": f"{event}:wedge", "SPILL_WEDGE_TIMEOUT": WEDGE_S,
               "SPILL_MAX_ROWS": "4"})
    assert texts(read_output(out)) == expected   # every custom_id once (read_output), each resident mlx-lm's text
    events = log_events("coordinator", own_home)
    assert [e["role"] for e in events if e.get("event") == "actor hung; killing it"] == [actor]
    assert [e["role"] for e in events if e.get("event") == "actor died; restarting"] == [actor]
