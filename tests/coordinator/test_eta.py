"""The live ETA of a running job: re-simulated from the rows left, with the refitted calibration and the
group's memory, within its share of the time."""

import json
import os

import pytest
import structlog

from spill.admission import calibration
from spill.streamer.plan import load_plan

from .group_util import seed_home


def _batch(tmp_path, n: int):
    lines = [json.dumps({"custom_id": f"r{i}", "prompt": "word " * 200, "max_tokens": 64}) for i in range(n)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "in.jsonl"


def test_the_live_eta_resimulates_the_rows_left_with_the_refitted_calibration(make_tiny, tmp_path, monkeypatch,
                                                                              fast_disk_home):
    from spill.admission.calibration import open_calibration
    from spill.admission.passmodel import Observation
    from spill.admission.simulate import SimRow
    from spill.coordinator.estimate import JobEstimate
    folder = make_tiny("llama")
    rows = [SimRow(i, 40 if i % 2 else 400, 16) for i in range(20)]
    job = JobEstimate(folder, rows, errors=0, every=0.0, share=float("inf"))   # no bound on its cost
    everything = job.eta(set(range(20)), {})
    assert everything == pytest.approx(job.first.total_seconds, rel=0.05)
    assert job.eta(set(range(10, 20)), {}) < everything
    assert job.eta(set(range(10, 20)), {r: 15 for r in range(10, 20)}) < job.eta(set(range(10, 20)), {})
    cal = open_calibration(folder)          # the admission actor refits: passes ten times slower than priced
    for _ in range(30):
        for rows_, prefill in ((4, 0), (8, 200), (16, 0)):
            c = 10 * cal.model.compute_s(Observation(rows_, prefill, 500, cal.streamed_bytes))
            cal.observe(Observation(rows_, prefill, 500, cal.streamed_bytes, seconds=c + 0.001, wait_s=0.0, compute_s=c))
    cal.save()
    assert job.eta(set(range(20)), {}) > 5 * everything


def test_a_resident_jobs_live_eta_prices_no_read_the_weights_being_in_memory(make_tiny, tmp_path, monkeypatch):
    from spill.admission.advisor import Advice
    from spill.admission.simulate import SimRow
    from spill.coordinator.estimate import JobEstimate
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(calibration, "read_probe", lambda files: 1e6)
    folder = make_tiny("llama")
    rows = [SimRow(i, 20, 6) for i in range(4)]
    job = JobEstimate(folder, rows, 0, every=0.0, advice=Advice(True, ""), share=float("inf"))   # re-simulate now
    read = load_plan(folder).streamed_bytes / 1e6
    assert job.first.total_seconds >= read                          # the first pass reads every layer
    assert job.eta({0, 1, 2, 3}, {}) < job.first.total_seconds - 0.5 * read   # mid-job they are in memory


def test_the_live_eta_spends_at_most_a_twentieth_of_the_time_re_simulating(monkeypatch):
    from types import SimpleNamespace

    from spill.coordinator import estimate
    clock, runs = [0.0], []

    def two_seconds(folder, rows, **_):   # a big job: each simulation takes 2 s of the clock
        runs.append(len(rows))
        clock[0] += 2.0
        return SimpleNamespace(total_seconds=1000.0), {}
    monkeypatch.setattr(estimate.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(estimate, "estimate_rows", two_seconds)
    job = estimate.JobEstimate(None, [], errors=0)
    while clock[0] < 400:   # polled every second, as `spill run` does
        clock[0] += 1.0
        job.eta({0}, {})
    assert 2.0 * len(runs) <= 0.05 * 400 + 2.0, runs


def test_an_eta_that_ran_out_with_rows_left_is_re_simulated_at_once(monkeypatch):
    """The ETA counts down between re-simulations (every 15 s): one that reached 0 with rows still
    pending showed "ETA 0h00m00s" for seconds; it is re-simulated as soon as its cost allows."""
    from types import SimpleNamespace

    from spill.coordinator import estimate
    clock = [0.0]
    monkeypatch.setattr(estimate.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(estimate, "estimate_rows", lambda folder, rows, **_: (SimpleNamespace(total_seconds=3.0), {}))
    job = estimate.JobEstimate(None, [], errors=0)
    clock[0] = 4.0                      # the first estimate was short: 3 s, and 4 s have passed
    assert job.eta({1}, {}) == 3.0      # re-simulated now, not at 15 s


def test_an_eta_that_ran_out_is_re_simulated_though_its_last_cost_is_over_its_share(monkeypatch):
    """A simulation that took 1 s waits 20 s (a twentieth of the time) before the next: a count-down that ran
    out with rows left read "ETA 0h00m00s" all that while. Once run out, it waits as long as the last one took."""
    from types import SimpleNamespace

    from spill.coordinator import estimate
    clock = [0.0]

    def one_second(folder, rows, **_):
        clock[0] += 1.0
        return SimpleNamespace(total_seconds=3.0), {}
    monkeypatch.setattr(estimate.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(estimate, "estimate_rows", one_second)
    job = estimate.JobEstimate(None, [], errors=0)
    clock[0] = 5.0                      # 4 s after the first estimate of 3 s, rows still pending
    assert job.eta({1}, {}) == 3.0      # re-simulated now, not 20 s after the last one
    runs = []
    monkeypatch.setattr(estimate, "estimate_rows", lambda folder, rows, **_: (
        runs.append(clock.__setitem__(0, clock[0] + 1.0)) or (SimpleNamespace(total_seconds=0.5), {})))
    while clock[0] < 105:               # a model that keeps running out: at most half the time simulating
        clock[0] += 0.1
        job.eta({1}, {})
    assert len(runs) <= 100 / 2 + 1


def test_a_jobs_estimate_and_eta_price_the_groups_budget_fraction(make_tiny, tmp_path, monkeypatch, fast_disk_home):
    from spill.coordinator import estimate
    monkeypatch.setattr(estimate, "group_rss", lambda pid, runtime=(0, 0): 1 << 20)   # not pytest's own memory
    folder = make_tiny("llama")
    batch = _batch(tmp_path, 64)
    log, ready = structlog.get_logger(), {"streamer": (1 << 20, 0)}
    full = estimate.job_estimate(folder, batch, set(range(64)), {}, {"memory": "48MiB"}, log, ready)
    half = estimate.job_estimate(folder, batch, set(range(64)), {}, {"memory": "48MiB", "budget_fraction": 0.4},
                                 log, ready)
    assert half.first.tiers[0].batch < full.first.tiers[0].batch
    assert half.first.total_seconds > full.first.total_seconds
    full.at = half.at = float("-inf")   # re-simulate now
    assert half.eta(set(range(64)), {}) > full.eta(set(range(64)), {})   # the ETA keeps the fraction (dropped: equal)


def test_the_eta_takes_the_groups_memory_as_admission_priced_it_and_remembers_it(make_tiny, tmp_path, monkeypatch,
                                                                                   llama_calibration):
    from types import SimpleNamespace
    from spill.admission.advisor import Advice
    from spill.admission.simulate import SimRow
    from spill.coordinator import estimate
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)
    monkeypatch.setattr(calibration, "read_probe", lambda files: 2e9)
    monkeypatch.setattr(estimate, "time", SimpleNamespace(monotonic=lambda: 1000.0))   # `every` never passes
    rows = [SimRow(i, 200, 64) for i in range(64)]
    job, same = (estimate.JobEstimate(make_tiny("llama"), rows, 0, memory="48MiB", advice=Advice(False, ""), every=3600.0)
                 for _ in range(2))
    before = job.eta(set(range(64)), {})
    job.priced(12 * 2**20)   # admission's Budget after the first pass
    after = job.eta(set(range(64)), {})
    same.at = float("-inf")   # the same rows re-simulated with the group's memory left at 0
    assert after != before and after > same.eta(set(range(64)), {})   # re-simulated at once, with that memory
    assert estimate.remembered_others() == 12 * 2**20


def test_before_the_streamer_is_ready_the_estimate_prices_the_group_as_the_last_job_did(make_tiny, tmp_path,
                                                                                        monkeypatch, fast_disk_home):
    from spill.coordinator import estimate
    estimate.remember_others(300 * 2**20)
    job = estimate.job_estimate(make_tiny("llama"), tmp_path / "none.jsonl", set(), {}, {}, structlog.get_logger(),
                                {"tokenizer": 1})
    assert job.others == 300 * 2**20
    monkeypatch.setattr(estimate, "group_rss", lambda pid, runtime=(0, 0): (7 * 2**20 if pid == os.getpid() else 0)
                        + runtime[0] - runtime[1])
    job = estimate.job_estimate(make_tiny("llama"), tmp_path / "none.jsonl", set(), {}, {}, structlog.get_logger(),
                                {"streamer": (5, 2)})
    assert job.others == 7 * 2**20 + 3   # measured: this process and its children, and the streamer's runtime


def test_the_eta_counts_down_from_the_first_pass_not_from_the_submit(make_tiny, tmp_path, monkeypatch, fast_disk_home):
    """The demo at a fresh home: the ETA read 0h00m00s at 10 of 20 rows of a 20 s job estimated at 23 s,
    its count-down started at the submit, before the model's load."""
    from spill.admission.advisor import Advice
    from spill.admission.simulate import SimRow
    from spill.coordinator import estimate
    rows = [SimRow(i, 200, 64) for i in range(64)]
    job = estimate.JobEstimate(make_tiny("llama"), rows, 0, memory="48MiB", advice=Advice(False, ""), every=3600.0)
    clock = job.at + 30.0   # the first pass, 30 s after the submit; the clock stands still on a busy machine too
    monkeypatch.setattr(estimate.time, "monotonic", lambda: clock)
    job.started(clock)
    assert job.eta(set(range(64)), {}) == job.first.total_seconds


def test_the_eta_is_zero_once_every_row_is_written(make_tiny, tmp_path, monkeypatch):
    """The live view's last line said "rows 20/20 ... ETA 0h00m04s": the count-down of the last simulation."""
    from spill.admission.advisor import Advice
    from spill.admission.simulate import SimRow
    from spill.coordinator.estimate import JobEstimate
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    from spill.coordinator import estimate
    monkeypatch.setattr(calibration, "read_probe", lambda files: 1e9)
    job = JobEstimate(make_tiny("llama"), [SimRow(i, 20, 6) for i in range(4)], 0, advice=Advice(False, ""))
    monkeypatch.setattr(estimate.time, "monotonic", lambda: job.at)   # no time passes, however busy the machine
    assert job.eta({3}, {}) > 0
    assert job.eta(set(), {}) == 0.0


@pytest.mark.parametrize("idle", [True, False])
def test_a_job_wider_than_its_calibration_is_probed_at_its_batch_only_where_no_job_runs(make_tiny, tmp_path,
                                                                                        monkeypatch, idle):
    from spill.coordinator import estimate, estimating
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(calibration, "read_probe", lambda files: 2e9)
    monkeypatch.setattr(estimate, "group_rss", lambda pid, runtime=(0, 0): 1 << 20)
    folder, batch = make_tiny("llama"), _batch(tmp_path, 64)
    calibration.open_calibration(folder)   # first use: probed at 16 rows
    probed = []
    monkeypatch.setattr(calibration, "pass_probe", lambda *a, **k: probed.append(a) or [])
    ask = {"folder": str(folder), "input": str(batch), "pending": list(range(64)), "defaults": {}, "others": 1 << 20,
           "args": {"memory": "1GiB"}, "idle": idle}
    assert "estimate" in estimating.work(ask)
    assert [a[3] for a in probed] == ([64] if idle else [])   # a streamer beside a running job's would take its memory


@pytest.mark.parametrize("idle", [True, False])
def test_a_jobs_draft_model_is_timed_by_its_estimate_only_where_no_job_runs(make_tiny, tmp_path, monkeypatch, idle):
    from spill.admission import drafter
    from spill.coordinator import estimate, estimating
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(calibration, "read_probe", lambda files: 2e9)
    monkeypatch.setattr(estimate, "group_rss", lambda pid, runtime=(0, 0): 1 << 20)
    folder, batch = make_tiny("llama"), _batch(tmp_path, 8)
    calibration.open_calibration(folder)
    timed = []
    monkeypatch.setattr(drafter, "probe", lambda folder, rows: timed.append(rows) or ([[1, 1, 0.01]], 0.0))
    ask = {"folder": str(folder), "input": str(batch), "pending": list(range(8)), "defaults": {"draft": str(folder),
           "speculate": 2}, "others": 1 << 20, "args": {"memory": "1GiB"}, "idle": idle}
    assert "estimate" in estimating.work(ask)
    assert len(timed) == (1 if idle else 0)   # a draft model loaded beside a running job's would take its memory
