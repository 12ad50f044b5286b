"""Writing a file whole: a hidden temporary name beside it, renamed over it once written, so a reader
(or a process that starts after a crash) finds the old file or the new one, never half of one."""

import contextlib
import fcntl
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from spill.errors import SpillError


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


def check_new_folder(out: Path) -> Path:
    """`out` as a folder to write, which must not exist or be empty; one sentence otherwise."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise SpillError(f"output path {out} is a file; give a folder path that does not exist yet")
    if out.is_dir() and any(out.iterdir()):
        raise SpillError(f"output folder {out} exists and is not empty; choose a new folder or empty it first")
    return out


@contextmanager
def new_folder(out: Path):
    """Yield a hidden empty folder beside `out` to write; when the block ends without an error it is renamed to
    `out` (checked by `check_new_folder`), else removed: a reader finds the whole folder or none."""
    out = check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()   # empty, checked above
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
