"""End to end, issue 8: a slow pass is not taken for a hang, foreign frames do no harm (a stopped streamer:
tests/chaos)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spill.wire import Endpoints

from .group_util import llama_job, log_events, read_output, seed_home, spill, texts


@pytest.fixture(scope="module")
def job8(make_tiny, tmp_path_factory):
    return llama_job(make_tiny, tmp_path_factory, 8, max_tokens=6)


def _ready(role: str, home: Path) -> int:
    return sum(e.get("event") == "ready" for e in log_events(role, home))


def test_a_slow_pass_is_not_taken_for_a_hang(job8, tmp_path, llama_calibration):
    folder, inp, _ = job8
    one = tmp_path / "one.jsonl"
    one.write_text(inp.read_text().splitlines()[0].replace('"max_tokens": 6', '"max_tokens": 2') + "\n")
    home = tmp_path / "home"     # a data home of its own: its logs are this group's alone
    seed_home(home, llama_calibration)
    spill("run", folder, one, "-o", tmp_path / "out.jsonl", "--quiet", check=True,
          env={"SPILL_HOME": str(home), "SPILL_LIVENESS_TIMEOUT": "2", "SPILL_STALL_TIMEOUT": "2",
               "SPILL_TEST_PASS_DELAY": "3"})   # each pass outlasts both deadlines
    assert log_events("coordinator", home), "the group wrote no log"
    assert not [e for e in log_events("coordinator", home) if e.get("event") in (
        "actor hung; killing it", "actor died; restarting", "rows outstanding while every actor is idle; submitting them again")]


FOREIGN = r"""
import json, sys, msgpack, zmq
from spill import messages as m
eps, control = json.loads(sys.argv[1]), sys.argv[2]
ctx = zmq.Context.instance()
frames = [b"", b"\xff" * 64, bytes([m.Kind.STOP]) + b"\xc1", bytes([m.Kind.STOP]) + msgpack.packb({"epoch": -1, "rows": []}),
          m.encode(m.Down()), m.encode(m.Ready("x", 1)), m.encode(m.Shutdown("foreign"))[:1] + b"\x01",
          bytes([m.Kind.DONE]) + msgpack.packb({"epoch": 0, "rows": [0, 1], "texts": ["x"], "finish": [], "prompt_tokens": [],
                                               "completion_tokens": []}),
          bytes([m.Kind.SUBMIT]) + msgpack.packb({"epoch": 0, "rows": [0], "requests": [{"kind": "chat"}]})]
for role in ("coordinator", "tokenizer", "admission", "streamer"):
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 10000)
    push.connect(eps[role])
    for frame in frames + [b"\x03" + b"x" * (2 << 20)]:   # the last one is over the 1 MB limit
        push.send(frame)
    push.close()
req = ctx.socket(zmq.REQ)
req.setsockopt(zmq.LINGER, 0)
req.connect(control)
req.send(bytes([m.Kind.PING]) + b"garbage")
print(m.decode(req.recv(), ).error if req.poll(10000) else "no reply")
req.close()
ctx.term()   # waits out the pushes' linger: an exit before ZeroMQ's IO thread sent them loses them (seen under load)
"""


def test_foreign_frames_on_every_socket_are_dropped_and_logged(job8, tmp_path, llama_calibration):
    folder, inp, expected = job8
    home = tmp_path / "home"     # a data home of its own: its logs are this group's alone
    seed_home(home, llama_calibration)
    env = {"SPILL_MAX_MESSAGE_MB": "1", "SPILL_HOME": str(home)}
    spill("up", check=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while any(_ready(role, home) == 0 for role in ("tokenizer", "admission", "streamer")) and time.monotonic() < deadline:
            time.sleep(0.2)     # `spill up` returns once the coordinator answers; its actors bind a little later
        eps = Endpoints.in_dir(home / "run")
        foreign = subprocess.run([sys.executable, "-c", FOREIGN, json.dumps(eps.as_dict()), eps.control],
                                 capture_output=True, text=True, timeout=60)
        assert foreign.stdout.startswith("not a spill request (Ping: not msgpack"), foreign.stdout + foreign.stderr
        spill("run", folder, inp, "-o", tmp_path / "out.jsonl", "--quiet", check=True, env=env)
    finally:
        spill("down", env=env)
    assert texts(read_output(tmp_path / "out.jsonl")) == expected
    for role in ("coordinator", "tokenizer", "admission", "streamer"):   # the coordinator takes a READY
        dropped = [e for e in log_events(role, home) if e.get("event") == "dropped a bad frame"]
        assert len(dropped) == (8 if role == "coordinator" else 9), (role, [e["why"] for e in dropped])
