"""Writing a file whole: a hidden temporary name beside it, renamed over it once written, so a reader
(or a process that starts after a crash) finds the old file or the new one, never half of one."""

import contextlib
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


def temporary_for(path: Path) -> Path:
    """The name `replaced` writes `path` under: hidden, one per process (concurrent writers never share it)."""
    return path.with_name(f".{path.name}.{os.getpid()}.part")


@contextmanager
def replaced(path: Path):
    """Yield a temporary path to write; when the block ends without an error it replaces `path`, else it
    is removed. Durability (fsync) is the caller's: write and fsync inside the block."""
    tmp = temporary_for(Path(path))
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fsync(fd: int) -> None:
    """fsync; on macOS F_FULLFSYNC, since plain fsync there leaves the data in the drive's cache."""
    if hasattr(fcntl, "F_FULLFSYNC"):
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
    os.fsync(fd)


def fsync_dir(path: Path) -> None:
    """Make a new or renamed entry in this folder durable (some filesystems refuse; then there is nothing to do)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
