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
    assert [r["max_tokens"] for r in submit.requests] == [5, 7]
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
    assert s["slots"] == [("a", 3, "abc"), ("b", 4, "def")]
