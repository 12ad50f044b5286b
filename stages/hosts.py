"""`spill up --hostfile FILE`: `mlx.launch` starts `spill up` on every host of MLX's hostfile, in a session of its
own so it outlives the command; this host (the hostfile's first: rank 0) runs the group, the others its stages.
The command returns once every host's rank has joined rank 0's group, as `spill up` returns once its group answers."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from spill import config
from spill.errors import SpillError

LAUNCH = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]   # `mlx.launch`


def hosts_in(hostfile: Path) -> int:
    """How many hosts MLX's hostfile names; a sentence that names the fix where it cannot be read as one."""
    try:
        data = json.loads(Path(hostfile).read_text())
    except (OSError, ValueError) as err:
        raise SpillError(f"--hostfile {hostfile}: {' '.join(str(err).split())}; write MLX's hostfile, "
                         '{"backend": "ring", "hosts": [{"ssh": "HOST", "ips": ["IP"]}, ...]}, rank 0 first '
                         "(docs/pipeline.md)") from None
    hosts = data.get("hosts") if isinstance(data, dict) else None
    if not isinstance(hosts, list) or len(hosts) < 2 or not all(isinstance(h, dict) and h.get("ssh") for h in hosts):
        raise SpillError(f"--hostfile {hostfile}: MLX's hostfile names two hosts or more, "
                         '{"backend": "ring", "hosts": [{"ssh": "HOST", "ips": ["IP"]}, ...]}, rank 0 first '
                         "(docs/pipeline.md); with one host, run `spill up` alone")
    return len(hosts)


def up_args(argv: list[str]) -> list[str]:
    """This `spill up`'s arguments (after `up`) less --hostfile and its value."""
    argv, rest = list(argv[argv.index("up") + 1:]), []
    while argv:
        arg = argv.pop(0)
        if arg == "--hostfile":
            argv.pop(0)
        elif not arg.startswith("--hostfile="):
            rest.append(arg)
    return rest


def status_reply():
    """The group on this host's status reply (messages.JobStatus), None where none answers yet."""
    from spill import messages as m
    from spill.coordinator.client import Client, endpoints
    client = Client(endpoints())
    try:
        return client.request(m.Status(), timeout_s=5) if client.ping() else None
    except SpillError:   # still starting
        return None
    finally:
        client.close()


def launch(hostfile: Path, ranks: int | None, argv: list[str] | None = None, status=status_reply,
           timeout_s: float = 120.0) -> str:
    """Start this `spill up` (`argv`, less --hostfile) on every host of `hostfile` through mlx.launch and wait until
    every host's rank has joined (`status()`, rank 0's reply); mlx.launch's output goes to run/logs/mlx-launch.out."""
    if ranks or "MLX_RANK" in os.environ:
        raise SpillError("--hostfile starts a rank a host: leave --ranks out, and run it outside mlx.launch")
    n, args = hosts_in(hostfile), up_args(sys.argv if argv is None else argv)
    from spill.coordinator import rundir
    if rundir.record() is not None:   # rank 0's `spill up` would find it, and the other hosts wait on a rank 0 never up
        raise SpillError(f"{rundir.held_by_sentence()}; `spill down` it before `spill up --hostfile`")
    log = config.home() / "run" / "logs" / "mlx-launch.out"   # not a .log: a group's start rotates those
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen([*LAUNCH, "--backend", "ring", "--hostfile", str(hostfile),
                                 "-p", str(config.ring_port()), "--",
                                 sys.executable, "-m", "spill.coordinator.cli", "up", *args],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while (s := status()) is None or s.joined < n - 1:   # every rank past 0 joined and told rank 0 its memory
        if proc.poll() is not None:
            tail = " | ".join(log.read_text().strip().splitlines()[-3:])
            raise SpillError(f"mlx.launch stopped (exit code {proc.returncode}) before the group of {n} hosts came up: "
                             f"{tail or 'it printed nothing'}; its output: {log}")
        if time.monotonic() > deadline:
            raise SpillError(f"no group of {n} ranks answered on this host within {timeout_s:g} s; run `spill up "
                             f"--hostfile` on the hostfile's first host (rank 0); mlx.launch (pid {proc.pid}) goes on, "
                             f"its output: {log}")
        time.sleep(0.2)
    return f"spill group up on {n} hosts (mlx.launch pid {proc.pid}, its output in {log}); `spill status` shows a stage a host"
