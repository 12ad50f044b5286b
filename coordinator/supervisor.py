"""Starts the actor processes, watches them, restarts one that died.

Each child gets the read end of a pipe whose write end only this process holds: when this
process dies the child reads EOF and exits (portable; macOS has no PDEATHSIG). A pipeline group's
streamer and its followers are one unit (ring.py): started, watched and ended together.
"""

import json
import os
import subprocess
import sys
import time

from spill import config
from spill.actor import failure_file, lost_file
from spill.platform import learn_device, preload_env

from .ring import Ring, end

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
        self.ring = Ring(self.args.get("ranks") or 1, memory=self.args)   # `spill up --ranks N`, or mlx.launch's ranks
        self.args["ranks"] = self.ring.ranks

    def start(self, role: str) -> None:
        read_end, write_end = os.pipe()
        args = {**self.args, "endpoints": self.endpoints.as_dict(), "parent_fd": read_end}
        env = preload_env() if role == "streamer" else dict(os.environ)
        if self.restarts[role]:
            env.pop(config.crash_name(role), None)   # a fault fires once, not on every restart
            if not config.test_alloc_fail()[1]:
                env.pop("SPILL_TEST_ALLOC_FAIL", None)
        if role == "streamer":   # a new ring for each streamer (MLX's group is fixed at init), or none
            env = self.ring.start(env)
            self.args["stages"] = args["stages"] = self.ring.size
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
        """Actors that exited, with their exit codes; a pipeline's streamer too once a follower of it exited."""
        streamer = self.procs.get("streamer")
        if streamer is not None and streamer.poll() is None and (gone := self.ring.exited()):
            self.ring.lose(gone[0], f"it exited with code {gone[1]}")
            self.kill("streamer")   # its ring is broken: it goes with it
        return [(role, p.returncode) for role, p in self.procs.items() if p.poll() is not None]

    def lost(self, role: str) -> str:
        """The sentence naming the rank a dead pipeline streamer lost, else "": the pipeline's end, not the job's."""
        return self.ring.take(lost_file(self.procs[role].pid)) if role == "streamer" else ""

    def layout(self) -> dict:
        """The group's ranks as the estimate prices them: stages, micro-batches, each follower's memory and link in."""
        return {"stages": self.args.get("stages", 1), "micro_batches": self.args.get("micro_batches"),
                "hosts": [h.row() for h in self.ring.memories]}

    def stages(self, folder: str | None, by_compute: bool = False, replicas: bool = False,
               own: dict | None = None) -> list[str]:
        """A line a rank (none for a group of one rank), as `spill status` shows them; `own`: rank 0's memory
        (`memory.describe`)."""
        streamer = self.procs.get("streamer")
        return self.ring.lines(folder, streamer.pid if streamer is not None and streamer.poll() is None else None,
                               by_compute, own, replicas)

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
        streamer = self.procs.get("streamer")
        if self.ring.size > 1 and streamer is not None:   # it lets its followers go first (told SHUTDOWN)
            try:
                streamer.wait(timeout / 2)
            except subprocess.TimeoutExpired:
                pass
        end(self.procs.values(), self._pipes.values(), timeout)
        self._pipes.clear()
        self.ring.stop()
