"""Where the group's sockets live and how an actor talks: one PULL inbox each, PUSH to the others.

    endpoint     bound by       connected by
    coordinator  coordinator    every actor (reports: READY, PASS, DONE, ERROR, PROGRESS, BUDGET)
    tokenizer    tokenizer      coordinator, streamer, admission
    admission    admission      tokenizer, streamer, coordinator
    streamer     streamer       admission, coordinator
    control      coordinator    clients (`spill run`, `spill status`, `spill down`): REQ/REP
"""

import hashlib
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog
import zmq

from . import config, messages
from .messages import Kind

ROLES = ("coordinator", "tokenizer", "admission", "streamer")
# The kinds each inbox takes; any other frame is dropped with one log line (add a new kind here).
ACCEPTS = {"coordinator": {Kind.READY, Kind.HEARTBEAT, Kind.PASS, Kind.DONE, Kind.ERROR, Kind.PROGRESS, Kind.BUDGET},
           "tokenizer": {Kind.RESET, Kind.SUBMIT, Kind.TOKENS, Kind.ENDED, Kind.SHUTDOWN},
           "admission": {Kind.RESET, Kind.TOKENIZED, Kind.PASS, Kind.STOP, Kind.SHUTDOWN},
           "streamer": {Kind.RESET, Kind.PLAN, Kind.SHUTDOWN}}
_IPC_MAX = 100   # macOS allows ~104 bytes in a socket path


@dataclass(frozen=True)
class Endpoints:
    coordinator: str
    tokenizer: str
    admission: str
    streamer: str
    control: str

    @classmethod
    def in_dir(cls, run_dir: Path, control: str | None = None) -> "Endpoints":
        config.check_writable(Path(run_dir))
        run_dir = socket_dir(run_dir)
        addr = {r: f"ipc://{run_dir / (r + '.sock')}" for r in ROLES}
        return cls(**addr, control=control or f"ipc://{run_dir / 'control.sock'}")

    def as_dict(self) -> dict:
        return asdict(self)



def socket_dir(run_dir: Path) -> Path:
    """run_dir itself (mode 0700), or a short private folder in /tmp when its path is too long."""
    run_dir = Path(run_dir)
    if len(str(run_dir / "coordinator.sock")) > _IPC_MAX:
        tag = hashlib.sha256(str(run_dir).encode()).hexdigest()[:10]
        run_dir = Path(tempfile.gettempdir()) / f"spill-{os.getuid()}-{tag}"
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    return run_dir


class Mailbox:
    """An actor's inbox (bound PULL) and its outboxes (connected PUSH) to the roles it sends to."""

    def __init__(self, endpoints: Endpoints, role: str, sends_to: tuple[str, ...]):
        self.ctx, self.endpoints = zmq.Context.instance(), endpoints
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes())   # zmq drops a bigger frame's peer
        self.role, self.accepts, self.dropped = role, {int(k) for k in ACCEPTS[role]}, 0
        self.lose, self.sent = config.test_drop(), 0   # tests: a message lost on the way
        address = getattr(endpoints, role)
        if address.startswith("ipc://") and os.path.exists(address[6:]):
            os.unlink(address[6:])   # left behind by a process that died
        self.inbox.bind(address)
        self.out = {}
        for peer in sends_to:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(getattr(endpoints, peer))
            self.out[peer] = sock

    def send(self, peer: str, msg) -> None:
        if type(msg).__name__.upper() == self.lose[0]:
            self.sent += 1
            if self.sent == self.lose[1]:
                return
        self.out[peer].send(messages.encode(msg))

    def recv(self, timeout_ms: int | None = None):
        """The next message, or None after timeout_ms (None: wait for ever)."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            wait = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if wait is not None and not self.inbox.poll(wait):
                return None
            msg = self._take(self.inbox.recv())
            if msg is not None:
                return msg

    def drain(self) -> list:
        out = []
        while self.inbox.poll(0):
            msg = self._take(self.inbox.recv())
            if msg is not None:
                out.append(msg)
        return out

    def _take(self, frame: bytes):
        """The checked message in a frame, or None (logged) for garbage or a kind this inbox does not take."""
        try:
            msg = messages.decode(frame)
            if frame[0] not in self.accepts:
                raise messages.BadMessage(f"{Kind(frame[0]).name} is not a message the {self.role} takes")
            return msg
        except messages.BadMessage as err:
            self.dropped += 1
            if self.dropped <= 10 or self.dropped % 1000 == 0:   # a flood of garbage is not a flood of logs
                structlog.get_logger().warning("dropped a bad frame", inbox=self.role, why=str(err),
                                               size=len(frame), dropped=self.dropped)
            return None

    def close(self) -> None:
        for sock in [self.inbox, *self.out.values()]:
            sock.close()
