"""A smaller machine: a job in a child memory cgroup whose limit is smaller than the model's files,
with no --memory flag. spill must find the limit itself and finish the job with no OOM kill."""

import json
import os
import sys

import pytest

from spill.factory import make_model

from ..cgroup_util import child_cgroup, drop_cache
from .group_util import read_output

LIMIT = 2**30
ROWS = 8


@pytest.fixture(scope="module")
def model_deep(tmp_path_factory):
    """The factory's `deep` llama (112 thin layers, ~1.36 GB in bf16): larger than the cgroup, while
    the few layers in flight and the KV of a few rows fit in it."""
    return make_model(tmp_path_factory.mktemp("deep") / "model", family="llama", size="deep")


def _last_event(home, event: str) -> dict:
    lines = (home / "run" / "logs" / "coordinator.log").read_text().splitlines()
    return [json.loads(line) for line in lines if f'"event": "{event}"' in line][-1]


def test_a_job_in_a_cgroup_smaller_than_the_model_finishes_without_an_oom_kill(model_deep, tmp_path, spill_home):
    assert sum(f.stat().st_size for f in model_deep.iterdir()) > LIMIT
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"Count to {i} slowly", "max_tokens": 2}) + "\n"
                           for i in range(ROWS)))
    drop_cache([model_deep])   # its pages are charged to the cgroup that reads them
    env = {**os.environ, "SPILL_PREFILL_TOKENS": "512"}   # a smaller prefill chunk leaves room for KV
    with child_cgroup(LIMIT) as cg:
        result = cg.run([sys.executable, "-m", "spill.coordinator.cli", "run", model_deep, inp,
                         "-o", tmp_path / "out.jsonl", "--quiet"], capture_output=True, text=True, timeout=600, env=env)
        kills = cg.oom_kills()
    assert kills == 0, result.stdout + result.stderr
    assert result.returncode == 0, result.stdout + result.stderr
    out = read_output(tmp_path / "out.jsonl")
    assert len(out) == ROWS and all(row["error"] is None for row in out.values())
    memory = _last_event(spill_home, "memory")
    assert (memory["source"], memory["working_set"]) == ("cgroup", LIMIT)
