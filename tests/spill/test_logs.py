"""Every process's log: JSON lines with actor, pid, job and pass index; rotation keeps the newest."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, threading
    from spill import messages as m
    from spill.actor import bind_context, setup_logging
    log = setup_logging("streamer")
    log.info("before any job")
    bind_context(m.Reset(epoch=1, model="", job="job-7"))
    for i in range(400):
        bind_context(m.Tokens(1, i, [], b"", [], []))
        log.info("pass done", n=i)
    t = threading.Thread(target=lambda: log.warning("from the reader thread"))
    t.start(); t.join()
""")


def run_logging(tmp_path, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPILL_HOME": str(tmp_path), **env}
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_are_json_with_actor_pid_job_and_pass(tmp_path):
    result = run_logging(tmp_path)
    assert result.returncode == 0, result.stderr
    lines = read_lines(tmp_path / "run" / "logs" / "streamer.log")
    assert len(lines) == 402
    assert {(e["actor"], type(e["pid"])) for e in lines} == {("streamer", int)}
    assert "job" not in lines[0] and "pass_index" not in lines[0]
    assert [(e["job"], e["pass_index"], e["n"]) for e in lines[1:4]] == [("job-7", 0, 0), ("job-7", 1, 1), ("job-7", 2, 2)]
    assert lines[-1]["event"] == "from the reader thread" and lines[-1]["actor"] == "streamer"
    # not a terminal: only the warning reaches stderr, as key=value
    assert result.stderr.count("\n") == 1 and "from the reader thread" in result.stderr and "actor=streamer" in result.stderr


def test_rotation_keeps_the_newest_lines(tmp_path):
    result = run_logging(tmp_path, SPILL_LOG_MAX_BYTES="4000", SPILL_LOG_BACKUPS="2")
    assert result.returncode == 0, result.stderr
    logs = tmp_path / "run" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["streamer.log", "streamer.log.1", "streamer.log.2"]
    assert all(p.stat().st_size <= 4000 for p in logs.iterdir())
    kept = [e for name in ("streamer.log.2", "streamer.log.1", "streamer.log") for e in read_lines(logs / name)]
    numbers = [e["n"] for e in kept if "n" in e]
    assert numbers == list(range(numbers[0], 400))          # the newest, in order, none missing
    assert numbers[0] > 300 and kept[-1]["event"] == "from the reader thread"


def test_a_log_level_keeps_lines_from_that_level_up(tmp_path):
    result = run_logging(tmp_path, SPILL_LOG_LEVEL="warning")
    assert result.returncode == 0, result.stderr
    assert [e["event"] for e in read_lines(tmp_path / "run" / "logs" / "streamer.log")] == ["from the reader thread"]


def test_a_bad_log_level_is_one_sentence_before_any_group_starts(tmp_path):
    env = {**os.environ, "SPILL_HOME": str(tmp_path), "SPILL_LOG_LEVEL": "loud"}
    result = subprocess.run([sys.executable, "-m", "spill.coordinator.cli", "up"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr == ("spill: SPILL_LOG_LEVEL='loud' is not a log level; set it to debug, info, warning "
                             "or error, or unset it\n")
