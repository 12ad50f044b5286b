"""The admission actor's measure of the other processes' memory, which the budget pays for."""

import json
import os
import subprocess
import sys
import time

import pytest

from spill.admission.process import _others_rss
from spill.memory import process_memory

ARGS = json.dumps({"endpoints": {"streamer": "ipc:///tmp/x/streamer", "admission": "ipc:///tmp/x/admission"}})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_every_process_of_the_group_but_the_streamer_is_counted():
    # the actors' command lines all name the streamer's endpoint; only the streamer's module is the streamer
    sleep = "import time; b = bytearray(40 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(30)"
    actor = subprocess.Popen([sys.executable, "-c", sleep, ARGS])
    streamer = subprocess.Popen([sys.executable, "-c", sleep, "-m", "spill.streamer.process", ARGS])
    try:
        time.sleep(1.5)   # both have touched their 40 MB
        expected = process_memory().rss + process_memory(actor.pid).rss
        measured = _others_rss(parent=os.getpid())
        assert abs(measured - expected) < 8 * 2**20, (measured, expected)
    finally:
        for p in (actor, streamer):
            p.kill()
            p.wait()
