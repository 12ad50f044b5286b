"""The coordinator's metrics, fed messages by hand the way the daemon feeds them."""

from types import SimpleNamespace

import pytest

from spill import messages as m
from spill import metrics as mt
from spill.coordinator.batch_input import read_batch
from spill.coordinator.jobrun import JobRun
from spill.coordinator.jobstore import Job
from spill.coordinator.telemetry import Telemetry, metrics_args
from spill.errors import SpillError


def value(name, **labels):
    return mt.REGISTRY.get_sample_value(name, labels) or 0.0


class FakeBox:
    def __init__(self):
        self.sent = []

    def send(self, peer, msg):
        self.sent.append((peer, msg))


@pytest.fixture
def group(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILL_METRICS_PORT", "0")
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(f'{{"custom_id": "r{i}", "prompt": "x"}}\n' for i in range(3)))
    requests, _ = read_batch(inp)
    run = JobRun(Job.create(inp, "demo", {}, tmp_path / "out.jsonl"), requests, "demo", {"max_tokens": 5})
    sup = SimpleNamespace(pids=lambda: {}, restarts={})
    g = SimpleNamespace(box=FakeBox(), sup=sup, epoch=1, current=run)
    tele = Telemetry(g, log=SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None))
    yield g, tele
    mt.REGISTRY.unregister(tele.processes)
    for gauge in vars(mt).values():
        if isinstance(gauge, mt.Unset):
            gauge.hide()


def feed(g, tele, msg):
    """What the daemon does: telemetry first, then the job."""
    tele.on_actor(msg)
    handler = {m.Done: g.current.on_done, m.Error: g.current.on_error, m.Pass: g.current.on_pass,
               m.Progress: g.current.on_progress}[type(msg)]
    handler(msg)
    tele.update()


def test_rows_tokens_and_passes_are_counted_once(group):
    g, tele = group
    before = {k: value(k) for k in ("spill_generated_tokens_total", "spill_prompt_tokens_total",
                                    "spill_streamed_bytes_total", "spill_pass_duration_seconds_count")}
    tele.update()
    for submit in g.current.submits(g.epoch):
        g.box.send("tokenizer", submit)
    drafts = {k: value("spill_draft_tokens_total", outcome=k) for k in ("proposed", "accepted")}
    feed(g, tele, m.Pass(1, 0, 2.0, 0.5, 1.2, 2, 10, 2, [], 100, 200, 300, drafted=[[0, 4], [1, 2]],
                         accepted=[[0, 3]], columns=5))
    assert value("spill_draft_tokens_total", outcome="proposed") - drafts["proposed"] == 6
    assert value("spill_draft_tokens_total", outcome="accepted") - drafts["accepted"] == 3
    tele.on_actor(m.Budget(1, 0, 1000, 780, 800, 900, 64, 0, 0, running_rows=2))   # admission counts the rows running
    feed(g, tele, m.Progress(1, [0, 1], [1, 1], ["a", "b"]))
    assert [value("spill_job_rows", state=s) for s in ("waiting", "running", "done", "failed")] == [1, 2, 0, 0]
    done = m.Done(1, [0], ["hi"], ["length"], [300], [5])
    feed(g, tele, done)
    feed(g, tele, done)   # a row recomputed after a crash reports twice; it is written once
    feed(g, tele, m.Error(1, [2], ["context_length_exceeded"], ["too long"]))
    assert [value("spill_job_rows", state=s) for s in ("waiting", "running", "done", "failed")] == [0, 1, 1, 1]
    assert value("spill_generated_tokens_total") - before["spill_generated_tokens_total"] == 5
    assert value("spill_prompt_tokens_total") - before["spill_prompt_tokens_total"] == 300
    assert value("spill_streamed_bytes_total") - before["spill_streamed_bytes_total"] == 300
    assert value("spill_pass_duration_seconds_count") - before["spill_pass_duration_seconds_count"] == 1
    assert value("spill_row_latency_seconds_count", tier="medium") >= 1   # from its SUBMIT, the job run's record
    assert value("spill_rows_completed_total", tier="unknown", reason="context_length_exceeded") >= 1
    assert value("spill_pass_phase_seconds_total", phase="overhead") >= 0.3 - 1e-9


def test_figures_without_a_source_are_not_exported(group):
    g, tele = group
    tele.update()
    names = {s.name for family in mt.REGISTRY.collect() for s in family.samples}
    assert not names & {"spill_memory_budget_bytes", "spill_read_probe_bytes_per_second", "spill_job_estimate_seconds"}


def test_admission_report_feeds_the_memory_lines_holds_and_preemptions(group):
    g, tele = group
    tele.update()
    before = {k: value(k) for k in ("spill_admission_holds_total", "spill_preemptions_total")}
    tele.on_actor(m.Budget(1, 3, 1000, 780, 800, 900, 64, held_rows=5, preempted_rows=2, probe_bandwidth=2.5e9))
    tele.on_actor(m.Budget(1, 4, 1000, 780, 800, 900, 64, held_rows=0, preempted_rows=1))   # no hold; no probe
    feed(g, tele, m.Pass(1, 4, 2.0, 0.5, 1.2, 2, 10, 2, [], 100, 200, 300, preempted=[1, 2]))   # counted once, by admission
    assert [value(f"spill_memory_{k}_bytes") for k in ("working_set", "budget", "guard", "hard")] == [1000, 780, 800, 900]
    assert value("spill_memory_live_bytes", kind="other_processes") == 64
    assert value("spill_read_probe_bytes_per_second") == 2.5e9
    assert value("spill_admission_holds_total") - before["spill_admission_holds_total"] == 1
    assert value("spill_preemptions_total") - before["spill_preemptions_total"] == 3


def test_the_estimate_its_error_and_the_eta_are_the_jobs_own(group):
    g, tele = group
    g.current.estimate = SimpleNamespace(first=SimpleNamespace(total_seconds=100.0), eta=lambda pending, generated: 40.0,
                                         started=lambda at: None)
    tele.update()
    assert value("spill_job_estimate_seconds") == 100.0
    feed(g, tele, m.Pass(1, 0, 2.0, 0.5, 1.2, 2, 10, 2, [], 100, 200, 300))
    assert value("spill_job_eta_seconds") == 40.0          # the live view's ETA, re-simulated from the estimate
    assert value("spill_job_estimate_error_ratio") == pytest.approx((2.0 + 40.0) / 100.0 - 1, abs=0.01)
    run = g.current
    feed(g, tele, m.Done(1, [0, 1, 2], ["a", "b", "c"], ["stop"] * 3, [3] * 3, [1] * 3))
    g.current = None   # the job ended: its actual time over the estimate, as its summary says
    tele.update()
    assert value("spill_job_estimate_error_ratio") == pytest.approx(run.summary()["actual_over_estimate"] - 1, abs=1e-3)
    g.current = JobRun(run.job, run.requests, "demo", {})   # a job without an estimate shows none
    tele.update()
    g.current.estimate = SimpleNamespace(first=SimpleNamespace(total_seconds=0.0), eta=lambda pending, generated: 0.0,
                                         started=lambda at: None)
    feed(g, tele, m.Pass(1, 0, 2.0, 0.5, 1.2, 2, 10, 2, [], 100, 200, 300))   # an estimate of 0 s: no ratio
    g.current.estimate = None
    names = {s.name for family in mt.REGISTRY.collect() for s in family.samples}
    assert not names & {"spill_job_estimate_seconds", "spill_job_estimate_error_ratio"}


def test_metrics_flags_name_the_fix(monkeypatch):
    monkeypatch.delenv("SPILL_METRICS_PORT", raising=False)
    monkeypatch.delenv("SPILL_METRICS_HOST", raising=False)
    with pytest.raises(SpillError, match=r"--metrics-port 70000 is not a port; give 1-65535, or 0 to serve no metrics"):
        metrics_args(None, 70000)
    import socket
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(SpillError, match=rf"cannot serve metrics on 127.0.0.1:{port}: the address is in use"):
            metrics_args("127.0.0.1", port)
    assert metrics_args(None, None) == {} and metrics_args(None, 0) == {"metrics_host": "127.0.0.1", "metrics_port": 0}
