"""A job's token counts for its estimate come from a child process: the coordinator never loads a tokenizer."""

import json
import os
import subprocess
import sys

from spill.coordinator.batch_input import read_batch
from spill.coordinator.lengths import measured_rows, sim_rows


def _input(tmp_path):
    lines = [json.dumps({"custom_id": f"r{i}", "prompt": "word " * (5 + 7 * i), "max_tokens": 8 + i}) for i in range(6)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "in.jsonl"


def test_the_child_counts_the_rows_asked_for_as_the_tokenizer_does(make_tiny, tmp_path):
    folder, path = make_tiny("llama"), _input(tmp_path)
    requests, _ = read_batch(path)
    rows, errors = measured_rows(folder, path, {0, 2, 3, 5}, {"max_tokens": 99})
    here, here_errors = sim_rows(folder, requests, [0, 2, 3, 5], {"max_tokens": 99})
    assert [(r.row, r.prompt, r.out) for r in rows] == [(r.row, r.prompt, r.out) for r in here]
    assert errors == here_errors == 0 and [r.row for r in rows] == [0, 2, 3, 5]


def test_a_submitted_jobs_estimate_leaves_no_tokenizer_in_the_coordinator(make_tiny, tmp_path):
    """transformers, mlx-lm and the model's tokenizer took 49 MiB of the coordinator for the group's life
    (lean45), and at a model's first use its calibration probes ran there too."""
    folder, path = make_tiny("llama"), _input(tmp_path)
    code = ("import sys, structlog\n"
            "from pathlib import Path\n"
            "from spill.coordinator.estimate import job_estimate\n"
            f"job = job_estimate(Path({str(folder)!r}), Path({str(path)!r}), set(range(6)), {{}}, {{}},"
            " structlog.get_logger(), {'streamer': (1, 0)})\n"
            "print(len(job.rows), sorted(m for m in ('transformers', 'tokenizers', 'mlx_lm') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SPILL_ESTIMATE_APART": "1"})   # the default (the suite sets 0)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "6 []"
