"""Talking to a running group: one request, one reply, with deadlines; and starting a group."""

import json
import os
import subprocess
import sys
import time

import zmq

from spill import config
from spill import messages as m
from spill.errors import SpillError
from spill.platform import preload_env
from spill.wire import Endpoints

from .control import check_address, client_token


class GroupDead(SpillError):
    """The group stopped answering: unrecoverable for this command (distinct from a row error)."""


def endpoints(listen: str | None = None) -> Endpoints:
    return Endpoints.in_dir(config.home() / "run", control=listen)


class Client:
    def __init__(self, eps: Endpoints, timeout_s: float = 30.0):
        self.eps, self.timeout_ms = eps, int(timeout_s * 1000)
        self.ctx = zmq.Context.instance()
        self.sock = None

    def request(self, op: str, timeout_s: float | None = None, **args) -> dict:
        sock = self._socket()
        sock.send(m.encode(m.Request(op, args, client_token(self.eps.control))))
        if not sock.poll(int(timeout_s * 1000) if timeout_s is not None else self.timeout_ms):
            self.close()   # a REQ socket that timed out cannot be reused
            raise GroupDead(f"the spill group did not answer `{op}`; see $SPILL_HOME/run/logs/, then `spill up` again")
        reply = m.decode(sock.recv())
        if not reply.ok:
            raise SpillError(reply.error)
        return reply.data

    def ping(self, timeout_s: float = 0.5) -> bool:
        try:
            self.request("ping", timeout_s=timeout_s)
            return True
        except GroupDead:
            return False

    def _socket(self):
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.REQ)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes())
            self.sock.connect(self.eps.control)
        return self.sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def start_group(eps: Endpoints, *, embedded: bool, actor_args: dict | None = None,
                timeout_s: float = 60.0) -> subprocess.Popen:
    """Start the coordinator (which starts the actors). Embedded: it dies with this process."""
    check_address(eps.control)
    args = {"endpoints": eps.as_dict(), "actor_args": actor_args or {}, "parent_fd": None}
    fds: tuple = ()
    if embedded:
        read_end, write_end = os.pipe()
        args["parent_fd"], fds = read_end, (read_end,)
    proc = subprocess.Popen([sys.executable, "-m", "spill.coordinator.daemon", json.dumps(args)],
                            pass_fds=fds, env=preload_env(), stdin=subprocess.DEVNULL,
                            start_new_session=not embedded,
                            stdout=subprocess.DEVNULL, stderr=_log_file())
    if embedded:
        os.close(fds[0])
        proc.parent_pipe = write_end   # kept open for the life of this process
    client, deadline = Client(eps), time.monotonic() + timeout_s
    while not client.ping():
        if proc.poll() is not None:
            raise GroupDead(f"the spill group exited at start (code {proc.returncode}); see $SPILL_HOME/run/logs/coordinator.log")
        if time.monotonic() > deadline:
            proc.kill()
            raise GroupDead(f"the spill group did not start within {timeout_s:.0f} s")
    client.close()
    return proc


def _log_file():
    logs = config.home() / "run" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return open(logs / "group.stderr", "ab")
