"""Who may drive the group: the control socket's address check, its frame limit and its token.

    ipc://$SPILL_HOME/run/control.sock   the run folder is 0700: only this user reaches it, no token
    tcp://127.0.0.1:PORT                 loopback: other local users can connect, so every request needs the token
    tcp://0.0.0.0:PORT, tcp://host:PORT  other hosts: only with `spill up --allow-remote`, and the token

The token is SPILL_TOKEN when set, else made at start and written to $SPILL_HOME/run/control.token (0600);
a client on another machine sets SPILL_TOKEN to that file's contents.
"""

import hmac
import ipaddress
import os
import secrets
from pathlib import Path

import zmq

from spill import config
from spill import messages as m
from spill.errors import SpillError, one_line

LOOPBACK_NAMES = ("localhost",)


def token_file() -> Path:
    return config.home() / "run" / "control.token"


def needs_token(address: str) -> bool:
    return address.startswith("tcp://")


def check_address(address: str, allow_remote: bool = False) -> None:
    """SpillError for a tcp address other hosts could reach, unless the user allowed it (`spill up --allow-remote`)."""
    if not needs_token(address) or allow_remote:
        return
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host in LOOPBACK_NAMES
    if not loopback:
        raise SpillError(f"--listen {address} lets other machines drive this group; use tcp://127.0.0.1:PORT, "
                         f"or pass --allow-remote to `spill up` (clients then need the token in {token_file()})")


def open_control(ctx: zmq.Context, address: str, allow_remote: bool = False) -> tuple[zmq.Socket, str]:
    """The bound REP socket and the token its requests must carry ("" for ipc)."""
    check_address(address, allow_remote)
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes())
    if address.startswith("ipc://") and os.path.exists(address[6:]):
        os.unlink(address[6:])
    sock.bind(address)
    token = ""
    if needs_token(address):
        token = config.token() or secrets.token_urlsafe(32)
        fd = os.open(token_file(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(fd, "w") as f:
            f.write(token + "\n")
    return sock, token


def client_token(address: str) -> str:
    """What a client sends: SPILL_TOKEN, else the token file of this data home, else nothing."""
    if not needs_token(address):
        return ""
    try:
        return config.token() or token_file().read_text().strip()
    except OSError:
        return ""


def authorized(token: str, sent: str) -> bool:
    return not token or hmac.compare_digest(token.encode(), sent.encode())


def refusal(address: str) -> str:
    return (f"the spill group at {address} refused this request: wrong or missing control token; "
            f"set SPILL_TOKEN to the contents of {token_file()} on the group's machine")


def answer(group, frame: bytes, token: str, address: str, log):
    """The reply to one control frame: a bad frame, a field out of its range or a wrong token gets Refused with one
    sentence, never silence."""
    try:
        req = m.decode(frame)
    except m.BadMessage as err:
        log.warning("bad control frame", why=str(err), size=len(frame))
        return m.Refused(f"not a spill request ({err})")
    if isinstance(req, m.REQUESTS) and not authorized(token, req.token):
        log.warning("control request refused: wrong token", op=req.op)
        return m.Refused(refusal(address))
    return group.handle(req)


def reply_frame(group, frame: bytes, token: str, address: str, log) -> bytes:
    """answer() encoded; a reply that cannot be encoded is a Refused naming why, so the client is never left waiting."""
    reply = answer(group, frame, token, address, log)
    try:
        return m.encode(reply)
    except Exception as err:  # noqa: BLE001 - a value the wire does not carry: a bug, the group's error, not its end
        log.error("reply not encoded", reply=type(reply).__name__, error=str(err))
        return m.encode(m.Refused(f"the group could not encode its {type(reply).__name__} ({one_line(err)}); "
                                  f"see {config.home() / 'run' / 'logs' / 'coordinator.log'}"))
