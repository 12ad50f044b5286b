"""Starts the actor processes, watches them, restarts one that died.

Each child gets the read end of a pipe whose write end only this process holds: when this
process dies the child reads EOF and exits (portable; macOS has no PDEATHSIG).
"""

import json
import os
import subprocess
import sys
import time

from spill import config
from spill.actor import failure_file
from spill.platform import learn_device, preload_env

ACTORS = {"tokenizer": "spill.tokenizer_worker.process", "admission": "spill.admission.process",
          "streamer": "spill.streamer.process"}


class Supervisor:
    def __init__(self, endpoints, args: dict | None = None, log=None):
        self.endpoints = endpoints
        self.args = {**(args or {}), "device": learn_device()}   # learnt in a child: no MLX here nor in most actors
        self.log = log
        self.procs: dict[str, subprocess.Popen] = {}
        self._pipes: dict[str, int] = {}
        self.restarts = {role: 0 for role in ACTORS}
        self.seen: dict[str, float] = {}      # role -> when it last said READY or beat its heart
        self.progress: dict[str, int] = {}    # role -> its loop's count at its last beat
        self.moved: dict[str, tuple[float, bool]] = {}   # role -> (when its count last moved, busy at its last beat)
        self.active_at = time.monotonic()     # when an actor last beat busy, or with its loop moved on

    def start(self, role: str) -> None:
        read_end, write_end = os.pipe()
        args = {**self.args, "endpoints": self.endpoints.as_dict(), "parent_fd": read_end}
        env = preload_env() if role == "streamer" else dict(os.environ)
        if self.restarts[role]:
            env.pop(config.crash_name(role), None)   # a fault fires once, not on every restart
            if not config.test_alloc_fail()[1]:
                env.pop("SPILL_TEST_ALLOC_FAIL", None)
        self.procs[role] = subprocess.Popen([sys.executable, "-m", ACTORS[role], json.dumps(args)],
                                            pass_fds=(read_end,), env=env, stdin=subprocess.DEVNULL)
        os.close(read_end)
        self.seen.pop(role, None)              # until its first beat, the READY deadline applies, not liveness
        self.progress.pop(role, None)
        self.moved.pop(role, None)
        if role in self._pipes:
            os.close(self._pipes[role])
        self._pipes[role] = write_end
        if self.log:
            self.log.info("started", role=role, actor_pid=self.procs[role].pid)

    def start_all(self) -> None:
        for role in ACTORS:
            self.start(role)

    def dead(self) -> list[tuple[str, int]]:
        """Actors that exited, with their exit codes."""
        return [(role, p.returncode) for role, p in self.procs.items() if p.poll() is not None]

    def why(self, role: str, final: bool = True) -> str:
        """The sentence a dead actor left for an error no restart fixes (spill.actor.run_actor), else "";
        not final: the first line of the exception it crashed on, else ""."""
        path = failure_file(self.procs[role].pid, final)
        try:
            why = path.read_text()
        except OSError:
            return ""
        path.unlink(missing_ok=True)
        return why

    def beat(self, role: str, pid: int, progress: int = 0, busy: bool = True) -> None:
        """A READY or heartbeat from the running process of role (one from a process already replaced is ignored)."""
        if role in self.procs and self.procs[role].pid == pid:
            self.seen[role] = now = time.monotonic()
            moved = self.progress.get(role) != progress
            at, was_busy = self.moved.get(role, (now, busy))
            self.moved[role] = (now if moved or not was_busy else at, busy)   # the deadline counts from busy on
            if busy or moved:
                self.active_at, self.progress[role] = now, progress

    def hung(self, deadline_s: float) -> list[str]:
        """Live actors that have not beaten for deadline_s seconds (stopped, or stuck holding the GIL)."""
        now = time.monotonic()
        return [role for role, p in self.procs.items()
                if p.poll() is None and role in self.seen and now - self.seen[role] > deadline_s]

    def wedged(self, deadline_s: float) -> list[str]:
        """Live actors that beat, busy, with their loop's count still for deadline_s seconds (a deadlock)."""
        now = time.monotonic()
        return [role for role, (at, busy) in self.moved.items()
                if busy and now - at > deadline_s and self.procs[role].poll() is None]

    def kill(self, role: str) -> None:
        """SIGKILL (which also ends a stopped process); dead() reports it and the usual restart follows."""
        self.procs[role].kill()
        self.procs[role].wait()

    def restart(self, role: str) -> None:
        self.restarts[role] += 1
        self.start(role)

    def pids(self) -> dict[str, int]:
        return {role: p.pid for role, p in self.procs.items()}

    def stop_all(self, timeout: float = 10.0) -> None:
        for fd in self._pipes.values():
            os.close(fd)   # children see EOF and exit
        self._pipes.clear()
        for p in self.procs.values():
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
