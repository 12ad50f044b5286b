"""The job store: rows on disk before they count, torn tails repaired, nothing written twice, inputs pinned."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from spill.coordinator import jobstore
from spill.coordinator.batch_output import error_line, success_line
from spill.coordinator.jobstore import Job, list_jobs
from spill.errors import SpillError
from spill.files import temporary_for


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def batch(tmp_path):
    path = tmp_path / "evals.jsonl"
    path.write_text('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "b", "prompt": "y"}\n')
    return path


def _ok(cid, text="out"):
    return success_line(cid, kind="completion", model="m", text=text, finish_reason="stop",
                        prompt_tokens=1, completion_tokens=1)


def _ids(path):
    return [json.loads(x)["custom_id"] for x in path.read_text().splitlines()]


def _refused(fn, *args) -> str:
    with pytest.raises(SpillError) as err:
        fn(*args)
    return str(err.value)


def test_create_lays_out_the_job(home, batch):
    job = Job.create(batch, "llama3.3:70b", {"max_tokens": 64})
    assert re.fullmatch(r"\d{6}-\d{6}-[0-9a-f]{6}", job.id)
    assert job.dir == home / "jobs" / job.id and not (job.dir / "logs").exists()   # log lines live in run/logs
    assert job.output_path == job.dir / "output.jsonl" and job.output_path.read_bytes() == b""
    meta = json.loads((job.dir / "job.json").read_text())
    assert meta == job.meta
    assert {k: meta[k] for k in ("input", "model", "params", "output", "status", "counts")} == {
        "input": str(batch), "model": "llama3.3:70b", "params": {"max_tokens": 64}, "output": None,
        "status": "queued", "counts": {"succeeded": 0, "failed": 0}}
    assert re.fullmatch(r"[0-9a-f]{64}", meta["input_sha256"]) and meta["created"] == meta["updated"]
    assert Job.open(job.id).meta == meta and job.done_ids() == set()


def test_ids_are_unique_and_listed_newest_first(batch):
    ids = [Job.create(batch, "m", {}).id for _ in range(3)]   # the same second: the hex keeps them apart
    assert len(set(ids)) == 3 and ids[0][:13] <= ids[1][:13] <= ids[2][:13]
    assert [m["id"] for m in list_jobs()] == sorted(ids, reverse=True)


def test_open_an_unknown_job(home):
    assert _refused(Job.open, "250101-000000-abcdef") == (
        f"no job '250101-000000-abcdef' in {home / 'jobs'}; `spill status` lists the jobs")
    assert "`spill status` lists the jobs" in _refused(Job.open, "../etc")


def test_find_the_unfinished_job_for_the_same_command(tmp_path, batch):
    out = tmp_path / "results.jsonl"
    job = Job.create(batch, "m", {})
    with_o = Job.create(batch, "m", {}, out)
    assert Job.find(batch, None, "m").id == job.id
    assert Job.find(tmp_path / "." / "evals.jsonl", out, "m").id == with_o.id   # same file, spelled differently
    assert Job.find(batch, None, "other-model") is None
    assert Job.find(batch, tmp_path / "elsewhere.jsonl", "m") is None
    job.set_status("interrupted")
    assert Job.find(batch, None, "m").id == job.id
    job.set_status("done")
    assert Job.find(batch, None, "m") is None


def test_append_is_fsynced_and_reopen_gives_done_ids(batch, monkeypatch):
    synced = []
    real = jobstore._fsync
    monkeypatch.setattr(jobstore, "_fsync", lambda fd: (real(fd), synced.append(fd)))
    job = Job.create(batch, "m", {})
    synced.clear()
    job.append([_ok("a"), error_line("b", code="context_length_exceeded", message="line 2: too long")])
    assert len(synced) == 1                      # one fsync per append, before it returns
    assert job.done_ids() == {"a", "b"} and job.counts() == {"succeeded": 1, "failed": 1}
    again = Job.open(job.id)
    assert again.done_ids() == {"a", "b"} and again.counts() == {"succeeded": 1, "failed": 1}
    assert again.repaired_bytes == 0
    job.set_status("running", total=2)
    assert Job.open(job.id).meta["counts"] == {"succeeded": 1, "failed": 1} and Job.open(job.id).meta["total"] == 2


def test_a_custom_id_is_never_written_twice(batch):
    job = Job.create(batch, "m", {})
    job.append([_ok("a", "first"), _ok("a", "again in the same call")])
    job.append([_ok("a", "later"), _ok("b")])
    Job.open(job.id).append([_ok("b", "after a restart"), _ok("a")])
    assert _ids(job.output_path) == ["a", "b"]
    assert json.loads(job.output_path.read_text().splitlines()[0])["response"]["body"]["choices"][0]["text"] == "first"


def test_bad_rows_without_custom_id_are_written_once_across_resumes(batch):
    bad = [error_line(None, code="invalid_json", message=f"line {n}: not valid JSON") for n in (3, 4)]
    job = Job.create(batch, "m", {})
    job.append(bad)
    Job.open(job.id).append(bad)                 # a re-run reports the same bad rows again
    assert len(job.output_path.read_text().splitlines()) == 2
    assert Job.open(job.id).done_ids() == set()


@pytest.mark.parametrize("tail", [b'{"id": "batch_req_1", "custom_id": "b", "resp',   # cut mid-line
                                  b"\x00" * 300,                                      # size grew, data never landed
                                  b'{"id": "batch_req_1", "custom_id": "b"\x00\x00\n'])  # garbage then a newline
def test_a_torn_last_line_is_cut_on_open(batch, tail):
    job = Job.create(batch, "m", {})
    job.append([_ok("a")])
    good = job.output_path.read_bytes()
    with open(job.output_path, "ab") as f:
        f.write(tail)
    again = Job.open(job.id)
    assert again.output_path.read_bytes() == good and again.repaired_bytes == len(tail)
    assert again.done_ids() == {"a"}
    again.append([_ok("b")])
    assert _ids(job.output_path) == ["a", "b"]


def test_a_changed_input_is_refused(batch):
    job = Job.create(batch, "m", {})
    job.append([_ok("a")])
    job.check_input()
    batch.write_text('{"custom_id": "a", "prompt": "changed"}\n')
    assert _refused(Job.open(job.id).check_input) == (
        f"{batch} changed since job {job.id} was created; restore it to continue that job, "
        f"or start a new job with `spill run --new` (1 rows already in {job.output_path} belong to the old input)")
    batch.unlink()
    assert _refused(job.check_input) == (
        f"{batch}, the input of job {job.id}, no longer exists; put it back to continue, "
        f"or start a new job with `spill run --new` (1 rows already in {job.output_path})")


def test_output_option_is_never_mixed_with_another_file(tmp_path, batch):
    out = tmp_path / "results.jsonl"
    out.write_text("someone else's data\n")
    assert _refused(Job.create, batch, "m", {}, out) == (
        f"{out} already exists and is not empty; choose another -o path, or move that file away")
    out.write_text("")
    job = Job.create(batch, "m", {}, out)        # an empty file is fine
    assert job.output_path == out
    job.append([_ok("a")])
    assert _refused(Job.create, batch, "other", {}, out) == (
        f"{out} is the output of job {job.id} (model m, queued); continue it with `spill run --resume {job.id}`, "
        f"or choose another -o path")
    Job.open(job.id).set_status("done")
    assert _refused(Job.create, batch, "m", {}, out) == (
        f"{out} holds the finished output of job {job.id}; choose another -o path, or move that file away to run again")
    missing = tmp_path / "no" / "r.jsonl"
    assert _refused(Job.create, batch, "m", {}, missing) == (
        f"folder {missing.parent} does not exist; create it or choose another -o path")
    assert _ids(out) == ["a"] and Job.open(job.id).done_ids() == {"a"}


def test_job_json_is_replaced_atomically(batch):
    job = Job.create(batch, "m", {})
    torn = temporary_for(job.dir / "job.json")
    torn.write_text("{torn")   # what a crash in the middle of set_status leaves
    assert Job.open(job.id).meta["status"] == "queued"
    job.set_status("failed", error="the group died")
    assert not torn.exists()
    assert json.loads((job.dir / "job.json").read_text())["error"] == "the group died"
    with pytest.raises(ValueError):
        job.set_status("paused")


def test_a_full_disk_leaves_no_torn_line(batch, monkeypatch):
    job = Job.create(batch, "m", {})
    job.append([_ok("a")])
    before = job.output_path.read_bytes()
    real = os.write

    def half_then_full(fd, data):
        real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jobstore.os, "write", half_then_full)
    assert _refused(job.append, [_ok("b")]) == (
        f"no space left to write {job.output_path}; free some space and run the same command again "
        f"to continue job {job.id}")
    monkeypatch.undo()
    assert job.output_path.read_bytes() == before and job.done_ids() == {"a"}


def test_one_process_per_job_and_a_reader_never_cuts_its_tail(batch):
    job = Job.create(batch, "m", {})
    job.lock()
    job.lock()                                   # holding it already is fine
    assert _refused(Job.open(job.id).lock) == (
        f"job {job.id} is being run by another spill process (pid {os.getpid()}); wait for it, "
        "or stop it with Ctrl-C in its `spill run` or with `spill down`")
    job.append([_ok("a")])
    with open(job.output_path, "ab") as f:      # the runner is mid-write
        f.write(b'{"id": "batch_req_1", "custom_id": "b"')
    size = job.output_path.stat().st_size
    assert Job.open(job.id).done_ids() == {"a"} and job.output_path.stat().st_size == size   # status reads only
    job.close()
    again = Job.open(job.id)
    again.lock()
    assert again.repaired_bytes > 0 and again.done_ids() == {"a"}


def test_a_killed_writer_loses_nothing_it_counted(home, batch, tmp_path):
    job = Job.create(batch, "m", {})
    child = textwrap.dedent(f"""
        from spill.coordinator.jobstore import Job
        from spill.coordinator.batch_output import success_line
        job = Job.open({job.id!r})
        for i in range(100000):
            job.append([success_line(f"r{{i}}", kind="chat", model="m", text="x" * 5000, finish_reason="stop",
                                     prompt_tokens=1, completion_tokens=1)])
            print(i, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "SPILL_HOME": str(home)})
    acked = [proc.stdout.readline() for _ in range(20)]   # rows whose append had returned
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    again = Job.open(job.id)
    assert {f"r{int(x)}" for x in acked} <= again.done_ids()
    assert _ids(again.output_path) == [f"r{i}" for i in range(len(again.done_ids()))]


def test_job_folders_are_private_and_outputs_0600(home, batch, tmp_path):
    """Issue 8, finding 7: outputs and job folders were world-readable."""
    old = os.umask(0o022)
    try:
        job = Job.create(batch, "m", {}, tmp_path / "out.jsonl")
        job.append([_ok("a")])
        default = Job.create(batch, "m", {})
    finally:
        os.umask(old)
    assert oct(job.dir.stat().st_mode & 0o777) == "0o700" and not (job.dir / "logs").exists()
    assert oct(jobstore.jobs_dir().stat().st_mode & 0o777) == "0o700"
    for path in (tmp_path / "out.jsonl", default.output_path, job.dir / "job.json"):
        assert oct(path.stat().st_mode & 0o777) == "0o600", path


def test_a_symlink_planted_after_the_check_is_not_followed(home, batch, tmp_path, monkeypatch):
    """Issue 8, finding 7: -o followed a symlink planted between the emptiness check and the first write."""
    target, out = tmp_path / "victim.txt", tmp_path / "out.jsonl"
    target.write_text("precious\n")
    check = jobstore.check_output_free

    def check_then_plant(path):
        check(path)
        os.symlink(target, path)
    monkeypatch.setattr(jobstore, "check_output_free", check_then_plant)
    message = _refused(Job.create, batch, "m", {}, out)
    assert message == f"{out} is a symbolic link; spill writes only to a regular file, give the real path with -o"
    assert target.read_text() == "precious\n" and jobstore.list_jobs() == []


def test_an_output_swapped_for_a_symlink_mid_job_is_not_written_through(home, batch, tmp_path):
    target, out = tmp_path / "victim.txt", tmp_path / "out.jsonl"
    target.write_text("precious\n")
    job = Job.create(batch, "m", {}, out)
    job.append([_ok("a")])
    out.unlink()
    os.symlink(target, out)
    assert _refused(job.append, [_ok("b")]).startswith(f"{out} is a symbolic link")
    assert target.read_text() == "precious\n"


def test_an_output_that_cannot_be_created_or_written_is_one_sentence(home, batch, tmp_path, monkeypatch):
    assert _refused(Job.create, batch, "m", {}, "/proc/x.jsonl").startswith("cannot create -o /proc/x.jsonl (")
    assert jobstore.list_jobs() == []
    job = Job.create(batch, "m", {}, tmp_path / "out.jsonl")
    job.append([_ok("a")])

    def read_only(fd, data):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(os, "write", read_only)
    assert _refused(job.append, [_ok("b")]) == (f"cannot write {tmp_path / 'out.jsonl'} (Read-only file system); fix "
                                                f"that and run the same command again to continue job {job.id}")
    monkeypatch.undo()
    assert _ids(tmp_path / "out.jsonl") == ["a"]


@pytest.mark.parametrize("odd", ["/dev/null", "/proc/version"])
def test_an_output_that_is_no_ordinary_file_is_refused_before_a_job(home, batch, odd):
    # a device cannot hold the record of rows done; a file of /proc cannot be flushed to disk
    said = _refused(Job.create, batch, "m", {}, odd)
    assert said.startswith(f"-o {odd} ") and "choose a file on a disk" in said, said
    assert jobstore.list_jobs() == []
