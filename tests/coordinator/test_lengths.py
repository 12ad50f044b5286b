"""A job's estimate is made in a child process: the coordinator never loads a tokenizer, and what the child
hands back is the estimate the coordinator would have made itself."""

import json
import os
import signal
import subprocess
import sys
import time

import structlog

from spill.coordinator.estimate import job_estimate
from spill.coordinator.estimating import Estimating

APART = {"SPILL_ESTIMATE_APART": "1"}   # the default (the suite sets 0)


def _input(tmp_path):
    lines = [json.dumps({"custom_id": f"r{i}", "prompt": "word " * (5 + 7 * i), "max_tokens": 8 + i}) for i in range(6)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "in.jsonl"


def _ask(folder, path, pending) -> dict:
    return {"folder": str(folder), "input": str(path), "pending": sorted(pending), "defaults": {"max_tokens": 99},
            "others": 5 << 20, "args": {"memory": "1GiB", "budget_fraction": None, "stream": True, "model": "m"}}


def _outcome(e: Estimating, timeout_s: float = 300) -> dict:
    e.start()
    deadline = time.monotonic() + timeout_s
    while (out := e.poll()) is None:
        assert time.monotonic() < deadline, "the estimate's child never ended"
        time.sleep(0.05)
    return out


def test_the_childs_estimate_is_the_one_made_here(make_tiny, tmp_path, monkeypatch, llama_calibration):
    monkeypatch.setenv("SPILL_ESTIMATE_APART", "1")
    folder, path = make_tiny("llama"), _input(tmp_path)
    out = _outcome(Estimating(_ask(folder, path, {0, 2, 3, 5}), probe=False))
    here = job_estimate(folder, path, {0, 2, 3, 5}, {"max_tokens": 99}, _ask(folder, path, ())["args"],
                        structlog.get_logger(), others=5 << 20)
    assert [r[:3] for r in out["estimate"]["rows"]] == [[r.row, r.prompt, r.out] for r in here.rows]
    assert [r[0] for r in out["estimate"]["rows"]] == [0, 2, 3, 5]
    assert out["estimate"]["first"]["total_seconds"] == here.first.total_seconds
    assert out["estimate"]["advice"]["line"] == here.advice.line


def test_a_model_the_child_cannot_read_is_its_sentence(make_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SPILL_ESTIMATE_APART", "1")
    out = _outcome(Estimating(_ask(tmp_path / "nowhere", _input(tmp_path), {0}), probe=False))
    assert set(out) == {"error"} and str(tmp_path / "nowhere") in out["error"]


def test_a_child_that_dies_costs_the_estimate_not_the_job(make_tiny, tmp_path, monkeypatch):
    """An estimate OOM-killed under a cap failed its job ("resume the job to try again"), and a resume would die
    the same way: the job goes on without an estimate, and says why."""
    monkeypatch.setenv("SPILL_ESTIMATE_APART", "1")
    monkeypatch.setenv("SPILL_TEST_ESTIMATE_DELAY", "60")
    e = Estimating(_ask(make_tiny("llama"), _input(tmp_path), {0}), probe=False)
    e.start()
    time.sleep(0.5)
    e.proc.send_signal(signal.SIGKILL)   # as the kernel's OOM killer ends it
    e.proc.wait(30)
    out = e.poll()
    assert out["estimate"] is None and "error" not in out
    assert "killed" in out["lost"] and "runs without one" in out["lost"], out


def test_a_submitted_jobs_estimate_leaves_no_tokenizer_in_the_coordinator(make_tiny, tmp_path):
    """transformers, mlx-lm and the model's tokenizer took 49 MiB of the coordinator for the group's life
    (lean45), and at a model's first use its calibration probes ran there too."""
    folder, path = make_tiny("llama"), _input(tmp_path)
    code = ("import sys, time\n"
            "from spill.coordinator.estimating import Estimating\n"
            f"e = Estimating({_ask(folder, path, range(6))!r}, probe=True)\n"
            "e.start()\n"
            "while (out := e.poll()) is None:\n"
            "    time.sleep(0.05)\n"
            "print(len(out['estimate']['rows']), sorted(m for m in ('transformers', 'tokenizers', 'mlx_lm', 'mlx')"
            " if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **APART})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "6 []"
