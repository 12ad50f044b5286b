"""What the tests and benchmarks ask of the machine they run on; spill itself uses none of it.

`ChildCgroup` makes a smaller machine: a child memory cgroup under this process's own, with a byte limit
(v1 or v2; root or a delegated cgroup needed). Page cache is charged to the cgroup of the process that
first reads a page, so drop a file from the cache before a command inside reads it. `blas_core` names the
OpenBLAS kernels a benchmark ran on.
"""

import ctypes
import os
import signal
import time
from pathlib import Path

from spill.memory import own_cgroup


def blas_core() -> str:
    """The CPU kernels the loaded OpenBLAS runs ("Haswell", "Cooperlake"), '' where none is loaded: a machine can
    force older ones (OPENBLAS_CORETYPE), so a benchmark's header names the ones that ran."""
    try:
        name = ctypes.CDLL(None).openblas_get_corename
    except (OSError, AttributeError):
        return ""
    name.restype = ctypes.c_char_p
    return (name() or b"").decode()



class ChildCgroup:
    def __init__(self, name: str, limit: int, parent: Path | None = None):
        """Make `<own cgroup>/<name>` (or `<parent>/<name>`: a v2 cgroup with no processes whose children
        have the memory controller) limited to `limit` bytes, swap off where the kernel lets us.
        Raises OSError where it cannot be made (no memory cgroup: FileNotFoundError)."""
        if parent is None:
            own = own_cgroup()
        else:   # v2 cgroups list their controllers in cgroup.controllers; v1 has no such file
            own = Path(parent), 2 if (Path(parent) / "cgroup.controllers").exists() else 1
        if own is None:
            raise FileNotFoundError("this process has no memory cgroup (see /proc/self/cgroup)")
        parent, self.version = own
        self.path = parent / name
        self.path.mkdir()
        try:
            (self.path / ("memory.limit_in_bytes" if self.version == 1 else "memory.max")).write_text(str(limit))
            for knob in ("memory.swappiness", "memory.swap.max"):
                if (self.path / knob).exists():
                    (self.path / knob).write_text("0")
        except OSError:
            self.path.rmdir()
            raise

    def command(self, cmd: list) -> list[str]:
        """`cmd` as a command that enters the cgroup first (its children stay inside too)."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path), *map(str, cmd)]

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

    def kill_all(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, within_s: float = 10.0) -> None:
        """Stop what is left inside, then remove the folder."""
        deadline = time.monotonic() + within_s
        while True:
            self.kill_all()
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

