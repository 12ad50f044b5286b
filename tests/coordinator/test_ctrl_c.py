"""Ctrl-C typed at a real terminal (a pty), on the embedded group and under `spill up`:
one press stops at a pass boundary and prints the resume command; two presses stop at once.
Either way nothing written is lost, and `spill run --resume` finishes the job."""

import os
import re
import signal
import time
from pathlib import Path

import pytest

from .group_util import llama_job, read_output, seed_home, spill, texts
from .pty_util import PtySpill

# 24 rows, 4 at a time, at least 0.1 s a pass: seconds of passes left after the third row, however busy the machine
SLOW = {"SPILL_MAX_ROWS": "4", "SPILL_TEST_PASS_DELAY": "0.1"}
HANG_S = 120   # a command still running after this long hangs; how fast it is belongs in a benchmark


@pytest.fixture(scope="module")
def job24(make_tiny, tmp_path_factory):
    return llama_job(make_tiny, tmp_path_factory, 24)


@pytest.fixture
def home(tmp_path, monkeypatch, llama_calibration):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)   # its groups need not probe the model again
    return tmp_path / "home"


@pytest.fixture(params=["embedded", "spill-up"])
def group(request, home):
    """How the job runs: on a group `spill run` starts for it, or under `spill up`."""
    if request.param == "spill-up":
        spill("up", check=True, env=SLOW)
    yield request.param
    if request.param == "spill-up":
        spill("down")


def _rows(out) -> int:
    return len(out.read_text().splitlines()) if out.exists() else 0


def _start(job24, out) -> PtySpill:
    folder, inp, _ = job24
    p = PtySpill("run", folder, inp, "-o", out, env=SLOW)
    p.wait_until(lambda _: _rows(out) >= 3)
    return p


def _job(p: PtySpill) -> str:
    return re.search(r"job (\S+): \d+ rows", p.output).group(1)


def _stall(home, sig) -> None:
    """Stop (or continue) the whole group: the coordinator and the actors it started."""
    coordinator = int((home / "run" / "coordinator.pid").read_text())
    children = (Path("/proc") / str(coordinator) / "task" / str(coordinator) / "children").read_text().split()
    for pid in [coordinator, *map(int, children)]:
        os.kill(pid, sig)


def _status_of(job: str) -> str:
    """`spill status JOB`; a group too busy to answer in its 10 s is asked again (its latency is not what this tests)."""
    deadline = time.monotonic() + HANG_S
    while (said := spill("status", job)).returncode != 0 and "did not answer" in said.stderr:
        assert time.monotonic() < deadline, said.stderr
    assert said.returncode == 0, said.stdout + said.stderr
    return said.stdout


def test_one_ctrl_c_stops_at_a_pass_boundary_and_prints_the_resume_command(job24, tmp_path, group):
    out = tmp_path / "out.jsonl"
    p = _start(job24, out)
    p.ctrl_c()
    assert p.wait(timeout=HANG_S) == 130, p.output
    job = _job(p)
    assert f"resume with: spill run --resume {job}" in p.output and "Traceback" not in p.output
    assert 3 <= len(read_output(out)) < 24
    assert f"{job} is interrupted" in _status_of(job) or f"job {job} interrupted" in _status_of(job)
    spill("run", "--resume", job, check=True)
    assert texts(read_output(out)) == job24[2]


def test_two_ctrl_c_stop_at_once_and_lose_nothing(job24, tmp_path, home, group):
    out = tmp_path / "out.jsonl"
    p = _start(job24, out)
    _stall(home, signal.SIGSTOP)           # a busy group: the first press's request gets no answer
    try:
        written = read_output(out)
        time.sleep(1.5)                    # the first press lands while a status request waits for its answer
        p.ctrl_c()
        time.sleep(0.2)                    # a quick second press: maybe before the first one's request went out
        p.ctrl_c()
        assert p.wait(timeout=HANG_S) == 130, p.output   # the group is stopped: only the client can end it
    finally:
        _stall(home, signal.SIGCONT)
    job = _job(p)
    assert "stopped at once" in p.output and f"resume with: spill run --resume {job}" in p.output
    deadline = time.monotonic() + HANG_S   # the group, running again, stops the job itself
    while "interrupted" not in _status_of(job):
        assert time.monotonic() < deadline, _status_of(job) + p.output
        time.sleep(0.2)
    after = read_output(out)
    assert all(after[cid] == row for cid, row in written.items())
    if group == "spill-up":   # its client left before its request could go: the file asked for the stop
        said = (home / "run" / "logs" / "coordinator.log").read_text()
        assert "stop asked by a second Ctrl-C" in said and "client gone" not in said
    spill("run", "--resume", job, check=True)
    assert texts(read_output(out)) == job24[2]


def test_one_ctrl_c_while_a_request_waits_still_stops_at_a_pass_boundary(job24, tmp_path, home, group):
    out = tmp_path / "out.jsonl"
    p = _start(job24, out)
    _stall(home, signal.SIGSTOP)           # the group stalls: the live view's status request waits
    try:
        time.sleep(1.5)
        p.ctrl_c()
        time.sleep(1.0)
    finally:
        _stall(home, signal.SIGCONT)
    assert p.wait(timeout=HANG_S) == 130, p.output
    job = _job(p)
    assert "stopped at a pass boundary" in p.output and "Traceback" not in p.output
    assert "interrupted" in _status_of(job)
    spill("run", "--resume", job, check=True)
    assert texts(read_output(out)) == job24[2]
