"""The run directory ($SPILL_HOME/run): one group at a time, and where every command finds it.

    run/group.lock   flock held by the coordinator for its life (a crash releases it)
    run/group.json   {"pid", "control"}: written once the coordinator listens; read by every command
    run/logs/        each process's log; a new group moves the last group's to <name>.1
"""

import contextlib
import fcntl
import json
import os
from pathlib import Path

from spill import config
from spill.errors import SpillError
from spill.files import replaced

from .jobstore import lock_held

LOCKED_EXIT = 75   # the coordinator's exit code when another group holds the run directory


def run_dir() -> Path:
    path = config.home() / "run"
    config.check_writable(path)   # one sentence naming SPILL_HOME when it cannot be made or written
    return path


def lock() -> int:
    """Take the run directory for this process (the fd holds it), or one sentence naming the group that has it."""
    fd = os.open(run_dir() / "group.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SpillError(held_by_sentence()) from None
    return fd


def held_by_sentence() -> str:
    rec = _read_json()
    pid, control = rec.get("pid", "?"), rec.get("control", "?")
    return (f"another spill group is running (coordinator pid {pid}, control {control}); "
            "submit to it with `spill run`, or stop it with `spill down`")


def write_record(pid: int, control: str) -> None:
    with replaced(run_dir() / "group.json") as tmp:
        tmp.write_text(json.dumps({"pid": pid, "control": control}))


def clear_record() -> None:
    (run_dir() / "group.json").unlink(missing_ok=True)


def record() -> dict | None:
    """{"pid", "control"} of the running group, or None when no group holds the run directory."""
    if not _held():
        return None
    return _read_json() or None


def _held() -> bool:
    return lock_held(run_dir() / "group.lock")


def _read_json() -> dict:
    with contextlib.suppress(OSError, ValueError):
        rec = json.loads((run_dir() / "group.json").read_text())
        if isinstance(rec, dict):
            return rec
    return {}


def rotate_logs() -> None:
    """Before a group starts: keep the last group's logs as <name>.1, so logs/ does not grow for ever."""
    config.log_level()   # a level the actors cannot use is refused here, in one sentence
    if _held():
        return
    logs = run_dir() / "logs"
    for path in logs.glob("*") if logs.is_dir() else ():
        if path.suffix in (".log", ".stderr"):
            os.replace(path, path.with_name(path.name + ".1"))


def remove_sockets(endpoints) -> None:
    """The group's ipc socket files, once every process that bound one has stopped."""
    for address in endpoints.as_dict().values():
        if address.startswith("ipc://"):
            Path(address[6:]).unlink(missing_ok=True)
