"""A submit answers at once: the job is `estimating` while a child of the coordinator counts its tokens and
calibrates its model, the group answers every client meanwhile, and the job goes on with its estimate, or fails
with the sentence of a model that cannot be read, never the group."""

import re
import shutil
import time
from pathlib import Path

import pytest

from spill import messages as m
from spill.coordinator.client import Client, endpoints
from spill.coordinator.jobstore import Job

from .group_util import read_output, seed_home, spill, texts, write_input
from .pty_util import PtySpill

APART = {"SPILL_ESTIMATE_APART": "1"}   # the default: the estimate in a child (the suite sets 0)
HANG_S = 120   # a command still running after this long hangs


@pytest.fixture
def home(tmp_path, monkeypatch, llama_calibration):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)
    return tmp_path / "home"


def _estimate_children(home: Path) -> list[int]:
    """Estimate children of groups in this data home still running."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if b"spill.coordinator.lengths" in (proc / "cmdline").read_bytes() and \
                    f"SPILL_HOME={home}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except (OSError, ValueError):
            pass
    return pids


def test_a_slow_estimate_leaves_submit_and_status_answering_at_once(make_tiny, tmp_path, home):
    write_input(tmp_path / "in.jsonl", 6, max_tokens=4)
    spill("up", check=True, env={**APART, "SPILL_TEST_ESTIMATE_DELAY": "6"})
    try:
        client, other = Client(endpoints()), Client(endpoints())
        started = time.monotonic()
        reply = client.request(m.SubmitJob(str(make_tiny("llama")), str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                                           client="test"), timeout_s=HANG_S)
        assert reply.status == "estimating" and time.monotonic() - started < 6   # before the estimate's delay ends
        seen = []
        while not seen or seen[-1] == "estimating":
            s = other.request(m.Status(reply.job, "test"), timeout_s=1)   # GroupDead after 1 s
            seen.append(s.status)
            time.sleep(0.1)
        assert seen.count("estimating") > 3 and seen[-1] in ("queued", "running", "done")
        while (s := other.request(m.Status(reply.job, "test"), timeout_s=5)).status != "done":
            assert time.monotonic() - started < HANG_S and s.status in ("queued", "running"), s
            time.sleep(0.2)
        assert s.estimate_line.startswith("estimate: ") and s.advice   # what `spill run` prints
        assert Job.open(reply.job).meta["estimate"]["line"] == s.estimate_line
        assert len(read_output(tmp_path / "out.jsonl")) == 6
        client.close()
        other.close()
    finally:
        spill("down")


def test_spill_status_says_a_job_is_estimating(make_tiny, tmp_path, home):
    write_input(tmp_path / "in.jsonl", 3)
    spill("up", check=True, env={**APART, "SPILL_TEST_ESTIMATE_DELAY": "60"})
    try:
        client = Client(endpoints())
        job = client.request(m.SubmitJob(str(make_tiny("llama")), str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                                         client="test"), timeout_s=HANG_S).job
        said = spill("status", job, check=True).stdout
        assert f"job {job} estimating: counting the rows' tokens" in said, said
        spill("cancel", job, check=True)
        client.close()
    finally:
        spill("down")
    assert _estimate_children(home) == []


@pytest.mark.parametrize("group", ["embedded", "spill-up"])
def test_ctrl_c_while_estimating_stops_the_job_and_leaves_nothing_running(make_tiny, tmp_path, home, group):
    folder = make_tiny("llama")
    rows = write_input(tmp_path / "in.jsonl", 6, max_tokens=4)
    slow = {**APART, "SPILL_TEST_ESTIMATE_DELAY": "60"}
    if group == "spill-up":
        spill("up", check=True, env=slow)
    try:
        p = PtySpill("run", folder, tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", env=slow)
        p.wait_until(lambda p: re.search(r"job (\S+): 6 rows", p.output), timeout=HANG_S)
        job = re.search(r"job (\S+): 6 rows", p.output).group(1)
        assert "estimating" in spill("status", job, check=True).stdout
        p.ctrl_c()
        assert p.wait(timeout=HANG_S) == 130, p.output
        assert f"stopped while estimating: 0/6 rows written; resume with: spill run --resume {job}" in p.output
        assert "Traceback" not in p.output
        assert Job.open(job).meta["status"] == "interrupted"
        deadline = time.monotonic() + 10   # the child is killed with its job, not left to finish
        while _estimate_children(home):
            assert time.monotonic() < deadline, "the estimate's child outlived its job"
            time.sleep(0.1)
    finally:
        if group == "spill-up":
            spill("down")
    spill("run", "--resume", job, check=True, env=APART)
    assert set(texts(read_output(tmp_path / "out.jsonl"))) == {r["custom_id"] for r in rows}


def test_a_model_the_estimate_cannot_read_fails_its_job_not_the_group_and_admission_never_probes(
        make_tiny, tmp_path, monkeypatch):
    """No calibration stored: the estimate's child probes the model; admission, which used to probe a model
    whose estimate had failed (loading MLX), gets a job only once its calibration is stored."""
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))   # nothing calibrated here
    broken = tmp_path / "broken"
    shutil.copytree(make_tiny("llama"), broken)
    (broken / "tokenizer.json").write_text("{ not json")
    write_input(tmp_path / "in.jsonl", 3)
    spill("up", check=True, env=APART)
    try:
        failed = spill("run", broken, tmp_path / "in.jsonl", "-o", tmp_path / "a.jsonl", env=APART)
        spill("run", make_tiny("llama"), tmp_path / "in.jsonl", "-o", tmp_path / "b.jsonl", check=True, env=APART)
        words = spill("status", check=True).stdout.splitlines()[0].split()
        pids = {words[i - 1]: int(words[i + 1]) for i, w in enumerate(words) if w == "pid"}
        assert "libmlx" not in Path(f"/proc/{pids['admission']}/maps").read_text(), "admission loaded MLX"
        assert len(read_output(tmp_path / "b.jsonl")) == 3
        assert failed.returncode == 1, failed.stdout + failed.stderr
        first_use, why = failed.stderr.splitlines()   # no "calibrated" line: it was not
        assert first_use == "calibrating this model on this machine (first use)"
        assert why.startswith(f"spill: {broken}: the tokenizer could not load (Failed to parse tokenizer.json"), why
    finally:
        spill("down")
