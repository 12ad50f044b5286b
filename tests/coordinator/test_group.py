"""End to end: real processes over ZeroMQ, on a tiny generated model."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .group_util import (assert_actors_exit, last_actor_pids, llama_job, log_events, read_output, resident_texts, spill, texts,
                         write_input)


@pytest.fixture(scope="module")
def job40(make_tiny, tmp_path_factory):
    return llama_job(make_tiny, tmp_path_factory, 40)


def test_embedded_run_matches_resident_mlx_lm(job40, tmp_path):
    folder, inp, expected = job40
    result = spill("run", folder, inp, "-o", tmp_path / "out.jsonl", check=True)
    assert "done: 40/40 rows" in result.stdout
    out = read_output(tmp_path / "out.jsonl")
    assert texts(out) == expected
    assert all(row["error"] is None for row in out.values())


def test_up_run_status_down(job40, tmp_path, make_tiny):
    folder, inp, expected = job40
    try:
        assert "spill group up" in spill("up", check=True).stdout
        first = spill("status", check=True).stdout.splitlines()
        assert first[1] == "no job running"
        # a group up without --memory names the source it detected (flags: test_memory_flags.py)
        assert first[2].startswith("memory: working set ") and "budget 78% = " in first[2]
        assert "(cgroup)" in first[2] or "(physical)" in first[2]
        spill("run", folder, inp, "-o", tmp_path / "out.jsonl", "--quiet", check=True)
        status = spill("status", check=True).stdout
        assert "tokenizer pid" in status and "streamer pid" in status
        other = make_tiny("qwen2")   # the next job names another model: the same group switches
        rows = write_input(tmp_path / "in2.jsonl", 6)
        spill("run", other, tmp_path / "in2.jsonl", "-o", tmp_path / "out2.jsonl", check=True)
    finally:
        assert spill("down").stdout.startswith(("spill group stopped", "no spill group is running"))
    assert texts(read_output(tmp_path / "out.jsonl")) == expected
    assert texts(read_output(tmp_path / "out2.jsonl")) == resident_texts(other, rows)
    status = spill("status", check=True).stdout.splitlines()
    assert status[0] == "no spill group is running" and status[1] == "jobs (newest first):"
    assert any(line.split()[1] == "done" and line.split()[2] == str(other) for line in status[2:])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")
def test_the_coordinator_and_admission_never_load_mlx(make_tiny, tmp_path):
    """Importing MLX's CUDA backend costs a process ~140 MB of its own memory (`benchmarks/group_memory.py`): the
    coordinator and admission, which never compute, load no MLX (the tokenizer's mlx-lm does)."""
    apart = {"SPILL_ESTIMATE_APART": "1"}   # the default: a job's tokens are counted in a child
    try:
        spill("up", check=True, env=apart)
        write_input(tmp_path / "in.jsonl", 3)
        spill("run", make_tiny("llama"), tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", check=True, env=apart)
        words = spill("status", check=True).stdout.splitlines()[0].split()
        pids = {words[i - 1]: int(words[i + 1]) for i, w in enumerate(words) if w == "pid"}
        for role in ("coordinator", "admission"):
            assert "libmlx" not in Path(f"/proc/{pids[role]}/maps").read_text(), f"the {role} loaded MLX"
        assert "libmlx" in Path(f"/proc/{pids['streamer']}/maps").read_text()
    finally:
        spill("down")


# each actor once, early to late (the job has ~8 passes: the old grid's 11 never crashed anything)
@pytest.mark.parametrize("actor,event,at", [("tokenizer", "tokens", 2), ("streamer", "pass", 4), ("admission", "pass", 7)])
def test_an_actor_killed_mid_job_is_restarted_and_the_job_finishes(job40, tmp_path, actor, event, at):
    folder, inp, expected = job40
    spill("run", folder, inp, "-o", tmp_path / "out.jsonl", check=True,
          env={f"SPILL_TEST_CRASH_{actor.upper()}": f"{event}:{at}"})
    assert texts(read_output(tmp_path / "out.jsonl")) == expected
    restarted = [e["role"] for e in log_events("coordinator") if e.get("event") == "actor died; restarting"]
    assert actor in restarted, restarted   # the crash did happen mid-job


@pytest.mark.parametrize("at", [1, 30])   # the first row and a late one (9 added no other path)
def test_a_killed_coordinator_leaves_a_job_resume_finishes(job40, tmp_path, at):
    folder, inp, expected = job40
    first = spill("run", folder, inp, "-o", tmp_path / "out.jsonl", env={"SPILL_TEST_CRASH_COORDINATOR": f"done:{at}"})
    assert first.returncode != 0
    assert_actors_exit(last_actor_pids())   # they watch their parent and leave with it
    job = first.stdout.split()[1].rstrip(":")
    assert f"resume with: spill run --resume {job}" in first.stderr
    spill("run", "--resume", job, check=True)
    assert texts(read_output(tmp_path / "out.jsonl")) == expected


def test_a_coordinator_killed_before_it_answers_submit_is_seen_at_once(job40, tmp_path):
    folder, inp, expected = job40
    started = time.monotonic()
    first = spill("run", folder, inp, "-o", tmp_path / "out.jsonl", timeout=120,
                  env={"SPILL_TEST_CRASH_COORDINATOR": "submit:1"})
    assert first.returncode == 1 and "the spill group stopped during `submit`" in first.stderr, first.stderr
    assert time.monotonic() - started < 60    # it waited 600 s for the reply before
    spill("run", folder, inp, "-o", tmp_path / "out.jsonl", check=True)   # the same command continues the job
    assert texts(read_output(tmp_path / "out.jsonl")) == expected


def test_sigint_stops_at_a_pass_boundary_and_resume_finishes(job40, tmp_path):
    folder, inp, expected = job40
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "spill.coordinator.cli", "run", str(folder), str(inp), "-o", str(out),
                             "--max-tokens", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SPILL_MAX_ROWS": "4", "SPILL_TEST_PASS_DELAY": "0.05"})
    deadline = time.monotonic() + 120
    while (not out.exists() or len(out.read_text().splitlines()) < 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout + stderr
    job = stdout.split()[1].rstrip(":")
    assert f"resume with: spill run --resume {job}" in stdout
    assert 3 <= len(read_output(out)) < 40
    spill("run", "--resume", job, check=True)
    assert texts(read_output(out)) == expected


def _busy_group(monkeypatch, tmp_path, answers_after: float):
    """A group that holds the run directory but answers only a request that waits `answers_after` s or more."""
    from spill import messages as m
    from spill.coordinator import rundir
    from spill.coordinator.client import Client
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    monkeypatch.setattr(Client, "ping", lambda self, timeout_s=0.5: 4242 if timeout_s >= answers_after else 0)
    monkeypatch.setattr(Client, "request", lambda self, req, **kw: m.JobStatus(processes={"coordinator": 4242}))
    monkeypatch.setattr(rundir, "record", lambda: {"pid": 4242})


def test_a_busy_group_is_waited_for_not_reported_as_not_running(monkeypatch, tmp_path):
    """`spill status` just after two submits said "no spill group is running" while the group read a job."""
    from spill.coordinator import run
    _busy_group(monkeypatch, tmp_path, answers_after=5)
    assert run.group_status(None, None).startswith("group: coordinator pid 4242")


def test_a_group_that_holds_its_run_directory_but_never_answers_is_one_sentence(monkeypatch, tmp_path):
    from spill.coordinator import run
    from spill.errors import SpillError
    _busy_group(monkeypatch, tmp_path, answers_after=float("inf"))
    for call in (lambda: run.group_status(None, None), lambda: run.cancel_job("j1", None), lambda: run.group_down(None)):
        with pytest.raises(SpillError, match=r"^the spill group \(coordinator pid 4242\) did not answer in 10 s"):
            call()
