"""A smaller machine for tests: a child memory cgroup under our own, with a limit.

Page cache is charged to the cgroup of the process that first reads a page, so files written
outside should be dropped from the cache (`drop_cache`) before a command inside reads them.
"""

import itertools
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from .machine import ChildCgroup
from spill.memory import own_cgroup

from .streamer._safetensors_util import drop_from_cache

_names = itertools.count()


class Cgroup(ChildCgroup):
    def run(self, cmd: list, **kw) -> subprocess.CompletedProcess:
        """Run `cmd` inside the cgroup (its children stay inside too)."""
        return subprocess.run(self.command(cmd), **kw)


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
    try:
        group = Cgroup(f"spill-test-{os.getpid()}-{next(_names)}", limit)
    except OSError as err:
        _cannot(f"cannot create a child of {parent} ({err.strerror}); tests need root or a delegated cgroup")
    try:
        yield group
    finally:
        group.remove()


def drop_cache(paths) -> None:
    """Evict these files (or every file under these folders) from the page cache; dirty pages are
    written first, since the kernel keeps those (a file just written would stay cached)."""
    for p in map(Path, paths):
        for f in ([p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]):
            drop_from_cache(f)
