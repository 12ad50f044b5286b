"""peers.py's capped runs: a child process in a fresh child memory cgroup, and the GPU's memory while it runs."""

import functools
import os
import subprocess
import tempfile
import threading
import time

from tests.machine import ChildCgroup
from spill.memory import parse_size
from pass_time import drop_cache
from peers_report import child_stages


def run_in(cg: ChildCgroup, cmd: list, timeout: float, env: dict) -> tuple[int | None, str, str, float]:
    """(exit code or None on timeout, stdout, stderr, seconds) of `cmd` started inside the cgroup."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cg.command(cmd), stdout=out, stderr=err, env=env, text=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            cg.kill_all()
            proc.wait()
        out.seek(0), err.seek(0)
        return rc, out.read(), err.read(), time.monotonic() - t0


def capped(a, name: str, cmd: list, env: dict, files, cap: str = "", timeout: float = 0) -> dict:
    """Run `cmd` in a fresh cgroup of `cap` (--cap) bytes; status ok / oom-killed / timeout / failed, with the facts."""
    drop_cache(files)
    try:
        cg = ChildCgroup(f"spill-peers-{os.getpid()}-{name}", parse_size(cap or a.cap), a.cgroup_parent or None)
    except OSError as err:
        raise SystemExit(f"cannot make a child memory cgroup here ({err}); run as root on Linux")
    try:
        with GpuWatch() as gpu:
            rc, out, err, wall = run_in(cg, cmd, timeout or a.timeout, env)
        kills, peak = cg.oom_kills(), cg.peak()
    finally:
        cg.remove()
    status = "ok" if rc == 0 else "timeout" if rc is None else "oom-killed" if kills else "failed"
    return {"status": status, "rc": rc, "oom_kills": kills, "cgroup_peak": peak, "wall_s": round(wall, 1),
            "stdout": out, **({"gpu_used_peak": gpu.peak, "gpu_samples": gpu.samples} if gpu.peak is not None else {}),
            **child_stages(err)}


def peak_within(samples: list, passes: list) -> int | None:
    """The GPU's memory in use at its most while spill's passes ran (from the first's start to the last's end),
    apart from the run's start (the group's processes and the first-use probe, which has a CUDA context of its own)."""
    if not samples or not passes:
        return None
    start, end = passes[0]["time"] - passes[0]["seconds"], passes[-1]["time"]
    inside = [u for t, u in samples if start <= t <= end]
    return max(inside) if inside else None


class GpuWatch:
    """The GPU's memory in use (nvidia-smi: every process's, CUDA contexts and allocators' caches included) at its
    most while a child runs, above what was in use before it started; `peak` None where no GPU answers. `samples`:
    (wall-clock time, bytes above that) every 0.2 s, so a phase of the run (spill's passes) has its own peak."""

    def __enter__(self) -> "GpuWatch":
        self.peak, self.samples, self._base, self._done = None, [], gpu_used(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True) if self._base is not None else None
        if self._thread:
            self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            self.samples.append((time.time(), (gpu_used() or self._base) - self._base))
        self.samples.append((time.time(), (gpu_used() or self._base) - self._base))
        self.peak = max(0, *(u for _, u in self.samples))

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread:
            self._thread.join()


def gpu_used() -> int | None:
    """Bytes in use on the first GPU, or None where nvidia-smi does not answer."""
    if not gpu_name():
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
        return int(out.stdout.split()[0]) << 20 if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


@functools.cache
def gpu_name() -> str:
    """The NVIDIA GPU's name where nvidia-smi answers, else '' (asked once)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
