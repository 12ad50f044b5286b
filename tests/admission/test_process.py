"""The admission actor's process wrapper: what it measures of the machine when it prices a model."""

import os
import subprocess
import sys
import time

from spill import memory
from spill.admission import process


def test_the_other_processes_are_priced_though_their_arguments_name_the_streamer(monkeypatch):
    """Every actor's command line carries the endpoints, which name the streamer's socket: only the
    streamer's own process may be left out of the others' resident memory."""
    endpoints = '{"endpoints": {"streamer": "ipc:///run/streamer.sock"}}'
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    sibling = subprocess.Popen([*sleep, endpoints])
    streamer = subprocess.Popen([*sleep, "-m", "spill.streamer.process", endpoints])   # argv as the streamer's
    try:
        time.sleep(1.0)
        monkeypatch.setattr(os, "getppid", os.getpid)   # we stand for the coordinator
        others = process._others_rss()
        ours, theirs = memory.process_memory(os.getpid()).rss, memory.process_memory(sibling.pid).rss
        assert ours + theirs - 2**20 <= others < ours + theirs + memory.process_memory(streamer.pid).rss - 2**20
    finally:
        sibling.kill()
        streamer.kill()
