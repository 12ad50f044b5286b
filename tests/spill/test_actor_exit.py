"""What an actor leaves behind when it stops on an error, for the supervisor to read (coordinator/supervisor.py)."""

import json
import os
import subprocess
import sys

import pytest

from spill.actor import failure_file

ENDPOINTS = {role: "ipc:///nowhere" for role in ("coordinator", "tokenizer", "admission", "streamer", "control")}
CODE = """import sys
from spill.actor import run_actor
from spill.errors import SpillError
def main(endpoints, args, log):
    raise {error}
run_actor("tokenizer", main)
"""


@pytest.mark.parametrize("error, final, left", [
    ("SpillError('x.safetensors changed; re-download it')", True, "x.safetensors changed; re-download it"),
    ("RuntimeError('[malloc] Unable to allocate 64 bytes.\\nat a line of its own')", False,
     "RuntimeError: [malloc] Unable to allocate 64 bytes")])
def test_an_actor_that_stops_on_an_error_leaves_its_sentence_or_its_first_line(tmp_path, monkeypatch, error, final, left):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    (tmp_path / "run").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", CODE.format(error=error), json.dumps({"endpoints": ENDPOINTS})],
                            env=os.environ, stderr=subprocess.PIPE)
    proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert failure_file(proc.pid, final).read_text() == left
    assert not failure_file(proc.pid, not final).exists()
