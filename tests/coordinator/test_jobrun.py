"""The coordinator's per-job state, fed messages by hand."""

from spill import messages as m
from spill.coordinator.batch_input import read_batch
from spill.coordinator.jobrun import JobRun
from spill.coordinator.jobstore import Job

from .group_util import read_output


def _run(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "b", "messages": [{"role": "user", "content": "y"}], '
                   '"max_tokens": 7}\n')
    requests, _ = read_batch(inp)
    job = Job.create(inp, "demo", {"max_tokens": 5}, tmp_path / "out.jsonl")
    return JobRun(job, requests, "demo", {"max_tokens": 5, "temperature": 0.0}), tmp_path / "out.jsonl"


def test_submits_carry_defaults_and_results_are_written_once(tmp_path):
    run, out = _run(tmp_path)
    (submit,) = run.submits(epoch=3)
    assert submit.epoch == 3 and submit.rows == [0, 1]
    assert [r.max_tokens for r in submit.requests] == [5, 7]
    done = m.Done(3, [1], ["hello"], ["length"], [4], [7])
    run.on_done(done)
    run.on_done(done)   # a row recomputed after a crash reports again
    assert run.pending == {0}
    run.on_error(m.Error(2, [0], ["context_length_exceeded"], ["too long"]))
    assert run.finished
    rows = read_output(out)
    assert rows["b"]["response"]["body"]["choices"][0]["message"]["content"] == "hello"
    assert rows["a"]["error"] == {"code": "context_length_exceeded", "message": "line 1: too long"}


def test_status_shows_progress_and_the_latest_slots(tmp_path):
    run, _ = _run(tmp_path)
    run.on_pass(m.Pass(1, 0, 2.0, 0.1, 1.8, 2, 10, 2, [], 100, 200, 300))
    run.on_progress(m.Progress(1, [0, 1], [3, 4], ["abc", "def"]))
    s = run.status()
    assert (s["done"], s["total"], s["pass_s"], s["peak_memory"]) == (0, 2, 2.0, 200)
    assert s["slots"] == [m.Slot("a", 3, "abc"), m.Slot("b", 4, "def")]


def test_a_job_that_ended_with_rows_left_shows_no_eta(tmp_path):
    """`spill status JOB` of a cancelled job said "ETA 0h18m30s"."""
    run, _ = _run(tmp_path)
    run.live_eta = lambda: 1110.0   # what the estimate says is left
    run.job.set_status("running")
    assert run.status()["eta_s"] == 1110.0
    for ended in ("cancelled", "interrupted", "failed"):
        run.job.set_status(ended)
        assert run.status()["eta_s"] is None, ended


def test_the_first_pass_starts_the_estimates_count_down(tmp_path):
    import time
    from types import SimpleNamespace
    run, _ = _run(tmp_path)
    starts = []
    run.estimate = SimpleNamespace(started=starts.append, eta=lambda pending, generated: 1.0)
    before = time.monotonic()
    run.on_pass(m.Pass(1, 0, 2.0, 0.1, 1.8, 2, 10, 2, [], 100, 200, 300))
    run.on_pass(m.Pass(1, 1, 2.0, 0.1, 1.8, 2, 10, 2, [], 100, 200, 300))
    assert len(starts) == 1 and before - 2.0 <= starts[0] <= time.monotonic() - 2.0   # when that pass began

def test_unseeded_rows_get_distinct_seeds_stable_across_resume(tmp_path):
    """Issue 8, finding 8: unseeded rows shared seeds (seed + rows + passes), so equal prompts gave equal text."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(f'{{"custom_id": "r{i}", "prompt": "same", "temperature": 1.0}}\n' for i in range(50))
                   + '{"custom_id": "own", "prompt": "same", "seed": 7}\n')
    requests, _ = read_batch(inp)
    job = Job.create(inp, "demo", {}, tmp_path / "out.jsonl")
    seeds = [r.sampling.seed for s in JobRun(job, requests, "demo", {}).submits(1) for r in s.requests]
    assert seeds[-1] == 7
    assert len(set(seeds[:-1])) == 50 and all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)
    again = [r.sampling.seed for s in JobRun(Job.open(job.id), requests, "demo", {}).submits(5) for r in s.requests]
    assert again == seeds
    other = Job.create(inp, "demo", {}, tmp_path / "out2.jsonl")
    assert [r.sampling.seed for s in JobRun(other, requests, "demo", {}).submits(1) for r in s.requests][:-1] != seeds[:-1]


def _many(tmp_path, n, monkeypatch, window):
    monkeypatch.setenv("SPILL_SUBMIT_WINDOW", str(window))
    inp = tmp_path / "many.jsonl"
    inp.write_text("".join(f'{{"custom_id": "r{i}", "prompt": "p{i}"}}\n' for i in range(n)))
    requests, _ = read_batch(inp)
    job = Job.create(inp, "demo", {}, tmp_path / "many.out.jsonl")
    return JobRun(job, requests, "demo", {"max_tokens": 1})


def _done(run, epoch, rows):
    run.on_done(m.Done(epoch, rows, ["x"] * len(rows), ["length"] * len(rows), [1] * len(rows), [1] * len(rows)))


def test_rows_go_to_the_group_in_a_window_refilled_as_rows_finish(tmp_path, monkeypatch):
    run = _many(tmp_path, 300, monkeypatch, window=100)
    first = run.submits(epoch=1)
    assert [s.rows for s in first] == [list(range(64)), list(range(64, 100))]
    _done(run, 1, list(range(10)))
    assert run.refill(1) == []                    # room for 10: wait for a full batch
    _done(run, 1, list(range(10, 70)))
    assert [s.rows for s in run.refill(1)] == [list(range(100, 164)), list(range(164, 170))]
    assert len(run.in_flight) == 100


def test_a_restart_resubmits_the_unfinished_rows_from_the_start(tmp_path, monkeypatch):
    run = _many(tmp_path, 300, monkeypatch, window=100)
    run.submits(epoch=1)
    _done(run, 1, [0, 5, 99])
    again = run.submits(epoch=2)                  # an actor restarted: the group holds nothing
    rows = [r for s in again for r in s.rows]
    assert rows == [r for r in range(103) if r not in (0, 5, 99)] and {s.epoch for s in again} == {2}


def test_every_row_is_fed_and_finished_with_a_small_window(tmp_path, monkeypatch):
    run = _many(tmp_path, 50, monkeypatch, window=4)
    submits, written = run.submits(epoch=1), []
    while submits:
        assert len(run.in_flight) <= 4
        rows = [r for s in submits for r in s.rows]
        _done(run, 1, rows[:3])                   # some finish, the rest wait
        run.on_error(m.Error(1, rows[3:], ["x"] * len(rows[3:]), ["y"] * len(rows[3:])))
        written += rows
        submits = run.refill(1)
    assert run.finished and sorted(written) == list(range(50))


def test_an_estimate_that_cannot_re_read_the_model_leaves_the_job_running_without_an_eta(tmp_path):
    """The live ETA re-plans the model's files; a shard cut short mid-job made that raise in the coordinator's loop
    (the group died: "the spill group stopped answering"). The ETA is a figure shown, never the group's end."""
    from types import SimpleNamespace

    from spill.errors import SpillError
    run, _ = _run(tmp_path)
    def replan(pending, generated):
        raise SpillError("model.safetensors: tensor x ends at byte 9, found a file of 4 bytes; re-download it")
    run.estimate = SimpleNamespace(started=lambda at: None, eta=replan, first=None)
    run.job.set_status("running")
    run.on_pass(m.Pass(1, 0, 2.0, 0.1, 1.8, 2, 10, 2, [], 100, 200, 300))
    assert run.live_eta() is None and run.passes == 1


def test_every_submit_fits_the_frame_cap_by_bytes_and_a_row_over_it_is_an_error_line(tmp_path, monkeypatch):
    """64 rows of up to 16 MB made one SUBMIT over the 256 MB cap, and ZeroMQ dropped it without a word."""
    monkeypatch.setenv("SPILL_MAX_MESSAGE_MB", "1")   # a SUBMIT holds 256 KiB at most
    inp = tmp_path / "big.jsonl"
    sizes = [100_000] * 9 + [300_000] + [100_000] * 5
    inp.write_text("".join(f'{{"custom_id": "r{i}", "prompt": "{"x" * n}"}}\n' for i, n in enumerate(sizes)))
    requests, _ = read_batch(inp)
    run = JobRun(Job.create(inp, "demo", {}, tmp_path / "big.out.jsonl"), requests, "demo", {"max_tokens": 1})
    submits = run.submits(epoch=1)
    assert [s.rows for s in submits] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 10], [11, 12], [13, 14]]
    assert all(len(m.encode(s)) <= (1 << 20) // 4 for s in submits)
    (line,) = read_output(tmp_path / "big.out.jsonl").values()
    assert line["custom_id"] == "r9" and line["error"]["message"] == (
        "line 10: the request is 0.3 MB, more than a message between spill's processes may carry (0.2 MB a row); "
        "raise SPILL_MAX_MESSAGE_MB to 2 or shorten it")

def test_the_pass_history_of_a_finished_job_ends_at_every_row_done(tmp_path):
    """A pass counts its rows before their lines are written: `spill report` drew a 20/20 job ending at 10 done."""
    from spill.coordinator import history
    run, _ = _run(tmp_path)
    run.submits(epoch=1)
    run.on_pass(m.Pass(1, 0, 2.0, 0.1, 1.8, 2, 10, 2, [0, 1], 100, 200, 300))   # both rows end in this pass
    run.on_done(m.Done(1, [0, 1], ["x", "y"], ["length", "length"], [1, 1], [5, 7]))
    passes = history.read(run.job.dir)
    assert len(passes) == 1 and passes[-1]["done"] == 2 == run.total


def test_the_summary_says_drafts_accepted_by_the_prompt_length_of_their_rows(tmp_path):
    from types import SimpleNamespace
    from spill.admission.simulate import SimRow
    from spill.coordinator.estimate_text import summary_lines
    run, _ = _run(tmp_path)
    run.estimate = SimpleNamespace(rows=[SimRow(0, 40, 5), SimRow(1, 900, 7)], first=SimpleNamespace(total_seconds=4.0),
                                   started=lambda at: None, eta=lambda *a: 0.0)
    for _ in range(2):   # the short row takes 1 of its 4 drafts, the long one all 4
        run.on_pass(m.Pass(1, 0, 2.0, 0.1, 1.8, 2, 0, 7, [], 100, 200, 300, drafted=[[0, 4], [1, 4]],
                           accepted=[[0, 1], [1, 4]]))
    s = run.summary()
    assert s["drafts"]["tiers"] == {"short (<=128)": 0.25, "long (>640)": 1.0}
    assert summary_lines(s)[-1] == ("drafts: 16 proposed, 10 accepted (62%); 3.50 tokens a decode row a pass; "
                                    "accepted by prompt length: short (<=128) 25%, long (>640) 100%")
