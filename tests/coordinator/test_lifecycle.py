"""A job's life as a user meets it, end to end: summaries and exit codes, re-running a finished
command, queued jobs, `spill cancel`, `spill down`, statuses after a crash, one group per data home
(found wherever it listens), MODEL resolved where the user typed it, and a tidy run directory."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from .group_util import read_output, seed_home, spill, write_input
from .pty_util import PtySpill

SLOW = {"SPILL_MAX_ROWS": "2", "SPILL_TEST_PASS_DELAY": "0.1", "SPILL_CLIENT_TIMEOUT": "3"}


@pytest.fixture
def home(tmp_path, monkeypatch, llama_calibration):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)   # its groups need not probe the model again
    return tmp_path / "home"


def _background(*args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spill.coordinator.cli", *map(str, args)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})


def _job_line(text: str) -> str:
    return re.search(r"job (\S+): \d+ rows", text).group(1)


def _wait_status(job: str, want: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        out = spill("status", job).stdout
        if re.search(rf"\b{want}\b", out.splitlines()[1] if out.startswith("group") else out):
            return out
        assert time.monotonic() < deadline, out
        time.sleep(0.2)


def test_failed_rows_are_counted_exit_3_and_a_finished_command_is_not_rerun(make_tiny, tmp_path, home):
    rows = write_input(tmp_path / "in.jsonl", 3, max_tokens=4)
    with open(tmp_path / "in.jsonl", "a") as f:
        f.write(json.dumps({"custom_id": "bad", "prompt": 5}) + "\n")
    (home / "run" / "logs").mkdir(parents=True)
    (home / "run" / "logs" / "coordinator.log").write_text("an old group's line\n" * 1000)
    first = spill("run", make_tiny("llama"), tmp_path / "in.jsonl")
    assert first.returncode == 3, first.stdout + first.stderr
    job = _job_line(first.stdout)
    assert f"job {job}: 4 rows, 1 invalid (an error line each in the output), 0 already done; output " in first.stdout
    assert f"job {job} done: 4/4 rows, 3 succeeded, 1 failed; output " in first.stdout
    assert 'their lines in the output carry "error"; the first: bad: line 4:' in first.stdout
    again = spill("run", make_tiny("llama"), tmp_path / "in.jsonl")
    assert again.returncode == 0 and again.stdout.startswith(f"job {job} already ran this command: done, 3 succeeded")
    assert "Add --new to run it again." in again.stdout
    assert len(list((home / "jobs").iterdir())) == 1 and len(rows) == 3
    # housekeeping: no empty per-job logs/, the last group's logs kept once, no socket left behind
    assert not (home / "jobs" / job / "logs").exists()
    assert (home / "run" / "logs" / "coordinator.log.1").read_text().startswith("an old group's line")
    assert "an old group's line" not in (home / "run" / "logs" / "coordinator.log").read_text()
    assert list((home / "run").glob("*.sock")) == [] and not (home / "run" / "group.json").exists()


def test_queued_jobs_ctrl_c_cancel_down_and_a_killed_client(make_tiny, tmp_path, home):
    folder = make_tiny("llama")
    for name in "abcde":   # a and d run while others wait: they must be long
        write_input(tmp_path / f"{name}.jsonl", 60 if name in "ad" else 12, max_tokens=8)
    spill("up", check=True, env=SLOW)
    try:
        a = _background("run", folder, tmp_path / "a.jsonl", "-o", tmp_path / "a.out")
        job_a = _job_line(a.stdout.readline())
        b = PtySpill("run", folder, tmp_path / "b.jsonl", "-o", tmp_path / "b.out")
        b.wait_until(lambda p: "queued behind job" in p.output)
        b.ctrl_c()                                   # Ctrl-C on a queued job
        assert b.wait(timeout=20) == 130, b.output
        job_b = _job_line(b.output)
        assert f"resume with: spill run --resume {job_b}" in b.output
        _wait_status(job_b, "interrupted")
        c = _background("run", folder, tmp_path / "c.jsonl", "-o", tmp_path / "c.out")
        job_c = _job_line(c.stdout.readline())
        _wait_status(job_c, "queued")
        c.kill()                                     # its client killed while queued: it leaves the queue
        c.communicate()
        _wait_status(job_c, "interrupted", timeout=20)
        cancelled = spill("cancel", job_a, check=True).stdout
        assert cancelled.startswith(f"job {job_a} cancelled (running, ")
        a_out, _ = a.communicate(timeout=30)
        assert a.returncode == 130 and f"job {job_a} cancelled:" in a_out
        d = _background("run", folder, tmp_path / "d.jsonl", "-o", tmp_path / "d.out")
        d.stdout.readline()
        e = _background("run", folder, tmp_path / "e.jsonl", "-o", tmp_path / "e.out")
        _wait_status(_job_line(e.stdout.readline()), "queued")
        down = spill("down", check=True).stdout
        assert down.startswith("spill group stopped")
        assert re.search(r"\(running, \d+/60 rows written\) is interrupted; resume with", down), down
        assert re.search(r"\(queued, 0/12 rows written\) is interrupted; resume with", down), down
        for proc in (d, e):
            out, _ = proc.communicate(timeout=30)
            assert proc.returncode == 130 and "interrupted" in out, out
        assert spill("run", "--resume", job_b).returncode == 0   # no longer held by the coordinator
        assert len(read_output(tmp_path / "b.out")) == 12
    finally:
        spill("down")


def test_a_job_whose_coordinator_died_is_interrupted_not_running(make_tiny, tmp_path, home):
    write_input(tmp_path / "in.jsonl", 12)
    first = spill("run", make_tiny("llama"), tmp_path / "in.jsonl",
                  env={"SPILL_TEST_CRASH_COORDINATOR": "done:3", "SPILL_MAX_ROWS": "2"})
    assert first.returncode != 0
    job = _job_line(first.stdout)
    assert f"no spill group is running; job {job} is interrupted" in spill("status", job).stdout
    assert re.search(rf"{job}\s+interrupted ", spill("status").stdout)


def test_one_group_per_data_home_found_wherever_it_listens_and_model_resolved_where_typed(make_tiny, tmp_path, home):
    # the job is typed in b with relative paths; the group was started in a
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    os.symlink(make_tiny("llama"), tmp_path / "b" / "m")
    write_input(tmp_path / "b" / "in.jsonl", 6)
    port = str(20000 + os.getpid() % 20000)
    up = spill("up", "--listen", port, check=True, cwd=tmp_path / "a").stdout
    try:
        assert f"control tcp://127.0.0.1:{port}" in up
        pid = re.search(r"coordinator pid (\d+)", up).group(1)
        status = spill("status", check=True).stdout          # no --listen: the record says where
        assert f"coordinator pid {pid}" in status
        for again in (spill("up"), spill("up", "--foreground", "--listen", str(int(port) + 1))):
            assert f"another spill group is running (coordinator pid {pid}" in again.stdout
        run = spill("run", "./m", "in.jsonl", "-o", "out.jsonl", cwd=tmp_path / "b")
        assert run.returncode == 0, run.stdout + run.stderr
        assert "done: 6/6 rows" in run.stdout and len(read_output(tmp_path / "b" / "out.jsonl")) == 6
        assert f"  ->  {tmp_path / 'b' / 'out.jsonl'}" in spill("status", check=True).stdout
    finally:
        assert spill("down").stdout.startswith("spill group stopped")
    assert list((home / "run").glob("*.sock")) == []


def test_two_runs_started_together_share_one_group(make_tiny, tmp_path, home):
    folder = make_tiny("llama")
    procs = []
    for name in "xy":
        write_input(tmp_path / f"{name}.jsonl", 8)
        procs.append(_background("run", folder, tmp_path / f"{name}.jsonl", "-o", tmp_path / f"{name}.out"))
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out + err
    assert all(len(read_output(tmp_path / f"{name}.out")) == 8 for name in "xy")


def test_the_first_error_of_a_row_with_no_custom_id_is_named_by_its_line(tmp_path):
    from spill.coordinator.run import _first_error
    out = tmp_path / "output.jsonl"
    out.write_text(json.dumps({"custom_id": None, "response": None,
                               "error": {"code": "invalid_request", "message": "line 1: custom_id is missing"}},
                              separators=(",", ":")) + "\n")   # compact, as the output writes it
    assert _first_error(out) == "line 1: custom_id is missing"
