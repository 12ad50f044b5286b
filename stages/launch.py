"""N ranks on this machine over the ring backend on loopback, started without `mlx.launch`: the same two
variables it sets (MLX_RANK, MLX_HOSTFILE: a JSON list of each rank's "ip:port"), on ports the kernel
picked free, so runs beside each other never collide on `mlx.launch`'s fixed starting port."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """n ports free on 127.0.0.1 now (held together while picked, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def hostfile(n: int, folder: Path) -> Path:
    """A ring hostfile of n ranks on loopback, in `folder`."""
    path = Path(folder) / "hostfile.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    return path


def spawn(n: int, argv: list[str], *, env: dict | None = None, folder: Path | None = None,
          cpus: list[set[int]] | None = None, rank_env: dict[int, dict] | None = None) -> list[subprocess.Popen]:
    """Start `python argv...` as ranks 0..n-1 of one ring; stdout and stderr piped, each in its own session,
    rank r on the cores cpus[r] where given, with rank_env[r] added to its environment."""
    hosts = hostfile(n, Path(folder or tempfile.mkdtemp(prefix="spill-ring-")))
    procs = []
    for rank in range(n):   # one rank is a group of its own: no ring to join
        ring = {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hosts)} if n > 1 else {}
        environ = {**os.environ, **(env or {}), **(rank_env or {}).get(rank, {}), **ring}
        pin = (lambda cores=cpus[rank]: os.sched_setaffinity(0, cores)) if cpus else None
        procs.append(subprocess.Popen([sys.executable, *argv], env=environ, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=pin))
    return procs


def wait(procs: list[subprocess.Popen], *, timeout: float) -> list[tuple[int, str, str]]:
    """Each rank's (exit code, stdout, stderr) once all have ended; every rank still running is killed past
    `timeout` seconds, or soon after one fails (the others would wait on it for ever)."""
    out = [None] * len(procs)
    pending, deadline = dict(enumerate(procs)), time.monotonic() + timeout
    try:
        while pending and time.monotonic() < deadline:
            for rank, p in list(pending.items()):
                try:
                    stdout, stderr = p.communicate(timeout=0.1)
                except subprocess.TimeoutExpired:
                    continue
                out[rank] = (p.returncode, stdout, stderr)
                del pending[rank]
                if p.returncode != 0:
                    deadline = min(deadline, time.monotonic() + 2.0)   # the others get a moment to say their side
    finally:
        for rank, p in pending.items():
            p.kill()
            stdout, stderr = p.communicate()
            out[rank] = (-9, stdout, stderr + "\n(killed: the run passed its time or another rank failed)")
    return out


def run(n: int, argv: list[str], *, timeout: float, env: dict | None = None,
        cpus: list[set[int]] | None = None) -> list[tuple[int, str, str]]:
    """`spawn` n ranks and `wait` for them."""
    return wait(spawn(n, argv, env=env, cpus=cpus), timeout=timeout)
