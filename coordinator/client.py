"""Talking to a running group: one request, one reply, with deadlines; and starting a group."""

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import zmq

from spill import config
from spill import messages as m
from spill.errors import GroupDead, SpillError
from spill.platform import preload_env
from spill.wire import Endpoints

from . import rundir
from .control import check_address, client_token


def endpoints(listen: str | None = None) -> Endpoints:
    """The group's addresses: its control socket is the one given, else the running group's recorded one."""
    rec = rundir.record() if listen is None else None
    return Endpoints.in_dir(config.home() / "run", control=listen or (rec or {}).get("control"))


class Client:
    def __init__(self, eps: Endpoints, timeout_s: float = 30.0):
        self.eps, self.timeout_ms = eps, int(timeout_s * 1000)
        self.ctx = zmq.Context.instance()
        self.sock = None
        self.alive = None    # set once the group's process is known: False the moment it has gone

    def request(self, req, timeout_s: float | None = None):
        """The group's reply to one request (m.REQUESTS): its own reply type; SpillError with the group's sentence
        where it refused, GroupDead where it did not answer."""
        sock = self._socket()
        sock.send(m.encode(replace(req, token=client_token(self.eps.control))))
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_ms / 1000)
        while (raw := self._receive(sock, deadline)) is None:
            gone = self.alive is not None and not self.alive()
            if gone or time.monotonic() >= deadline:
                raise GroupDead(f"the spill group {'stopped' if gone else 'did not answer'} during `{req.op}`; "
                                "see $SPILL_HOME/run/logs/, then run the command again")
        try:
            reply = m.decode(raw)
        except m.BadMessage as err:
            raise SpillError(f"the spill group's answer to `{req.op}` is not a reply this client reads ({err}); "
                             "run the same spill version as the group (`spill down`, then start it again)") from None
        if isinstance(reply, m.Refused):
            raise SpillError(reply.error)
        if not isinstance(reply, m.REPLIES[type(req)]):
            raise SpillError(f"the spill group answered `{req.op}` with a {type(reply).__name__}; run the same spill "
                             "version as the group (`spill down`, then start it again)")
        return reply

    @staticmethod
    def _receive(sock, deadline: float) -> bytes | None:
        """The reply, or None after a second at most: a late answer to an earlier request wakes the
        poll but the socket drops it, so the read must not block."""
        if sock.poll(max(1, int(min(1.0, deadline - time.monotonic()) * 1000))):
            try:
                return sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                pass
        return None

    def ping(self, timeout_s: float = 0.5) -> int:
        """The coordinator's pid, or 0 when no group answers."""
        try:
            return self.request(m.Ping(), timeout_s=timeout_s).pid
        except GroupDead:
            return 0

    def _socket(self):
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.REQ)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes())
            # a request left unanswered (timed out, Ctrl-C) must not stop the next one, nor drop the
            # connection: a stalled group still finds a later `interrupt` queued when it wakes
            self.sock.setsockopt(zmq.REQ_RELAXED, 1)
            self.sock.setsockopt(zmq.REQ_CORRELATE, 1)
            self.sock.connect(self.eps.control)
        return self.sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def start_group(eps: Endpoints, *, embedded: bool, actor_args: dict | None = None, group_args: dict | None = None,
                timeout_s: float = 60.0) -> subprocess.Popen | None:
    """Start the coordinator (which starts the actors) in its own session, so the terminal's Ctrl-C
    reaches only this client. Embedded: it stops once this process has gone and its jobs are over.
    None: another group took the run directory meanwhile; `endpoints()` now finds that one. `group_args`: the
    coordinator's own (`spill up`'s allow_remote, metrics_host, metrics_port)."""
    group_args = group_args or {}
    check_address(eps.control, group_args.get("allow_remote", False))
    rundir.rotate_logs()
    args = {"endpoints": eps.as_dict(), "actor_args": actor_args or {}, "group_args": group_args, "parent_fd": None}
    fds: tuple = ()
    if embedded:
        read_end, write_end = os.pipe()
        args["owner_fd"], args["owner"], fds = read_end, os.getpid(), (read_end,)
    proc = subprocess.Popen([sys.executable, "-m", "spill.coordinator.daemon", json.dumps(args)],
                            pass_fds=fds, env=preload_env(), stdin=subprocess.DEVNULL, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=_log_file())
    if embedded:
        os.close(fds[0])
        proc.owner_pipe = write_end   # kept open while this process follows its job
    client, deadline = Client(eps), time.monotonic() + timeout_s
    while (pid := _ping_starting(client)) != proc.pid:
        if proc.poll() == rundir.LOCKED_EXIT or pid:   # another group answers: ours will not start
            if embedded:
                os.close(write_end)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            return None
        if proc.poll() is not None:
            raise GroupDead(f"the spill group exited at start (code {proc.returncode}); see $SPILL_HOME/run/logs/coordinator.log")
        if time.monotonic() > deadline:
            proc.kill()
            raise GroupDead(f"the spill group did not start within {timeout_s:.0f} s")
    client.close()
    return proc


def _ping_starting(client: "Client") -> int:
    """ping while a group starts: a refusal means its token file is not written yet."""
    try:
        return client.ping()
    except SpillError:
        time.sleep(0.05)
        return 0


def leave_group(proc: subprocess.Popen, client: "Client", timeout_s: float = 30.0) -> None:
    """An embedded group's owner is done: close its pipe; wait for the group to stop unless
    another `spill run` joined it and still has a job there."""
    os.close(proc.owner_pipe)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if client.request(m.Status(), timeout_s=0.5).job:
                return
        except (GroupDead, SpillError):
            pass
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _log_file():
    logs = config.home() / "run" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return open(logs / "group.stderr", "ab")
