"""Writing a file whole: a hidden temporary name beside it, renamed over it once written, so a reader
(or a process that starts after a crash) finds the old file or the new one, never half of one."""

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
