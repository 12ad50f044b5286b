"""A smaller machine for tests: a child memory cgroup under our own, with a limit.

Page cache is charged to the cgroup of the process that first reads a page, so files written
outside should be dropped from the cache (`drop_cache`) before a command inside reads them.
"""

import itertools
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from spill.memory import own_cgroup

from .streamer._safetensors_util import drop_from_cache

_names = itertools.count()


class Cgroup:
    def __init__(self, path: Path, version: int):
        self.path, self.version = path, version

    def run(self, cmd: list, **kw) -> subprocess.CompletedProcess:
        """Run `cmd` inside the cgroup (its children stay inside too)."""
        enter = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
        return subprocess.run(["sh", "-c", enter, str(self.path), *map(str, cmd)], **kw)

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def oom_kills(self) -> int:
        """Processes the kernel OOM-killed in this cgroup so far."""
        text = self._read("memory.oom_control" if self.version == 1 else "memory.events")
        return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")), 0)

    def peak(self) -> int | None:
        """The most memory charged to it at once (page cache included), where the kernel says."""
        try:
            return int(self._read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"))
        except (OSError, ValueError):
            return None

    def pids(self) -> list[int]:
        return [int(p) for p in self._read("cgroup.procs").split()]

    def remove(self, within_s: float = 10.0) -> None:
        """Stop what is left inside (processes this test started), then remove the folder."""
        deadline = time.monotonic() + within_s
        while True:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def _cannot(reason: str):
    pytest.skip(f"no child memory cgroup can be made here: {reason}")


@contextmanager
def child_cgroup(limit: int):
    """A child memory cgroup of our own with `limit` bytes (swap off where the kernel lets us);
    removed afterwards. Skips the test, saying why, where one cannot be made."""
    if not sys.platform.startswith("linux"):
        _cannot("cgroups are a Linux feature")
    own = own_cgroup()
    if own is None:
        _cannot("this process has no memory cgroup (see /proc/self/cgroup)")
    parent, version = own
    if version == 2 and "memory" not in (parent / "cgroup.subtree_control").read_text().split():
        _cannot(f"the memory controller is not enabled for children in {parent}/cgroup.subtree_control")
    path = parent / f"spill-test-{os.getpid()}-{next(_names)}"
    try:
        path.mkdir()
    except OSError as err:
        _cannot(f"cannot create {path} ({err.strerror}); tests need root or a delegated cgroup")
    group = Cgroup(path, version)
    try:
        (path / ("memory.limit_in_bytes" if version == 1 else "memory.max")).write_text(str(limit))
        for name in ("memory.swappiness", "memory.swap.max"):
            if (path / name).exists():
                (path / name).write_text("0")
        yield group
    finally:
        group.remove()


def drop_cache(paths) -> None:
    """Evict these files (or every file under these folders) from the page cache; dirty pages are
    written first, since the kernel keeps those (a file just written would stay cached)."""
    for p in map(Path, paths):
        for f in ([p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]):
            drop_from_cache(f)
