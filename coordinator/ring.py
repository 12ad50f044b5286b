"""A pipeline group's ranks around the streamer actor: rank 0 is the streamer, ranks 1..N-1 each a
`python -m spill.stages.serve` following it (stages/staged.py).

`spill up --ranks N` starts the followers here, on loopback, with ports the kernel picked free and a new hostfile
each time the streamer starts: the streamer and its followers are one unit. Under `mlx.launch`, which runs
`spill up` on every rank, the followers are its processes and the streamer inherits rank 0's MLX_RANK and
MLX_HOSTFILE. A lost rank (a follower exited, or the streamer's `StageLost`) ends the ring: MLX's group is fixed
at init, so the streamer starts again alone and holds every layer (streamed, any model fits one rank).
"""

import json
import os
import statistics
import subprocess
import sys
from collections import deque
from pathlib import Path

from spill import config
from spill.errors import SpillError
from spill.memory import format_size

RING_VARS = ("MLX_RANK", "MLX_HOSTFILE")   # MLX's launcher contract: this rank, every rank's "ip:port"
KEPT = 32   # passes a stage's median pass time is taken over


def launched_hosts(env=None) -> list[str] | None:
    """Each rank's host where `mlx.launch` made this process rank 0 of several, else None."""
    env = os.environ if env is None else env
    if env.get("MLX_RANK") != "0" or not env.get("MLX_HOSTFILE"):
        return None
    try:
        hosts = [str(addrs[0]).rsplit(":", 1)[0] for addrs in json.loads(Path(env["MLX_HOSTFILE"]).read_text())]
    except (OSError, ValueError, TypeError, IndexError, KeyError):
        return None
    return hosts if len(hosts) > 1 else None


class Ring:
    def __init__(self, ranks: int = 1, env=None, memory: dict | None = None):
        """`memory`: the group's --memory and --budget-fraction (`memory.memory_args`), its followers' here too."""
        env = os.environ if env is None else env
        self.memory = memory or {}
        self.launched, self.hostfile = launched_hosts(env), env.get("MLX_HOSTFILE", "")
        self.ranks = len(self.launched) if self.launched else max(1, int(ranks or 1))
        self.hosts = self.launched or ["127.0.0.1"] * self.ranks
        self.alone = False        # a rank was lost: rank 0 holds every layer from then on
        self.started = 0          # rings started (one that mlx.launch made starts once)
        self.followers: dict[int, subprocess.Popen] = {}
        self._pipes: list[int] = []
        self.lost: list[str] = []   # each lost rank's sentence, newest last
        self.pending = ""           # the latest, until the supervisor hands it on
        self.memories: list = []    # each follower's memory (messages.Host), as the streamer's READY told it
        self.passes: list[deque] = []   # each stage's last passes (messages.StagePass), as its pass reports told them

    @property
    def size(self) -> int:
        """The ranks the streamer runs on now."""
        return 1 if self.alone else self.ranks

    def start(self, env: dict) -> dict:
        """A new ring: the followers started where spill runs them; the streamer's environment (rank 0's
        variables, or none where it runs alone)."""
        self.stop()
        self.memories, self.passes = [], []   # the new streamer tells them again
        env = {k: v for k, v in env.items() if k not in RING_VARS}
        if self.size == 1:
            return env
        if self.launched:
            if self.started:   # mlx.launch's ranks followed the streamer that ended and are gone with it
                self.lose(-1, "they ended with the streamer that crashed", tell=False)
                return env
            self.started += 1
            return {**env, "MLX_RANK": "0", "MLX_HOSTFILE": self.hostfile}
        from spill.stages.launch import hostfile
        folder, logs = config.home() / "run" / "ring", config.home() / "run" / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        path = hostfile(self.ranks, folder)
        for rank in range(1, self.ranks):
            read_end, write_end = os.pipe()
            mine = {**env, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(path)}
            mine.pop(config.crash_name("streamer"), None)   # the streamer's fault, not its followers'
            with open(logs / f"stage-{rank}.log", "ab") as log:
                self.followers[rank] = subprocess.Popen(
                    [sys.executable, "-m", "spill.stages.serve", "--parent-fd", str(read_end), *self._memory_argv()],
                    pass_fds=(read_end,),
                    env=mine, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            os.close(read_end)
            self._pipes.append(write_end)
        self.started += 1
        return {**env, "MLX_RANK": "0", "MLX_HOSTFILE": str(path)}

    def _memory_argv(self) -> list[str]:
        """A follower's memory arguments on this machine: the group's own (it finds the same budget)."""
        mem, fraction = self.memory.get("memory"), self.memory.get("budget_fraction")
        return [*(["--memory", str(mem)] if mem else []), *(["--budget-fraction", str(fraction)] if fraction else [])]

    def ready(self, hosts: list) -> None:
        """The followers' memory (messages.Host, rank 1 first), as the streamer told it at READY."""
        self.memories = list(hosts)

    def observe(self, stages: list) -> None:
        """A pass report's stage figures (messages.StagePass): rank 0's, then each follower's that came."""
        for rank, figures in enumerate(stages[:self.size]):
            while len(self.passes) <= rank:
                self.passes.append(deque(maxlen=KEPT))
            self.passes[rank].append(figures)

    def exited(self) -> tuple[int, int] | None:
        """(rank, exit code) of a follower that exited, else None."""
        for rank, p in self.followers.items():
            if p.poll() is not None:
                return rank, p.returncode
        return None

    def lose(self, rank: int, cause: str, tell: bool = True) -> None:
        """Rank `rank` (-1: several) is gone: the streamer runs alone from its next start; `tell`: the sentence waits
        for the job (a crash that took the ranks with it is the crash's to tell)."""
        one = 0 < rank < len(self.hosts)
        where = f"rank {rank} on {self.hosts[rank]}" if one else "its other ranks"
        self.alone = True
        if one and rank in self.followers:   # one that stopped answering would not see its pipe's EOF: no wait for it
            self.followers[rank].kill()
        if tell:
            self.pending = (f"the group lost {where} ({cause}); rank 0 goes on alone holding every layer, "
                            "and the job's unfinished rows are computed again")
        label = f"stage {rank}" if one else "stage 1" if self.ranks == 2 else f"stages 1-{self.ranks - 1}"
        self.lost.append(f"{label}: lost ({where}: {cause}); rank 0 holds every layer")

    def take(self, lost_file: Path | None = None) -> str:
        """The sentence of a rank lost since the last call ("" if none); `lost_file`: what a streamer that ended on
        `StageLost` left (the rank it waited on and why)."""
        if not self.pending and lost_file is not None and lost_file.exists():
            try:
                said, gone = json.loads(lost_file.read_text()), self.exited()
                if gone:   # the streamer saw the link drop before the follower's exit was seen: the exit says more
                    self.lose(gone[0], f"it exited with code {gone[1]}")
                else:
                    self.lose(int(said.get("rank", -1)), _cause(str(said.get("why", ""))))
            except (OSError, ValueError, TypeError):
                self.lose(-1, "the streamer lost its neighbour")
        if lost_file is not None:
            lost_file.unlink(missing_ok=True)
        said, self.pending = self.pending, ""
        return said

    def lines(self, folder: str | None, streamer_pid: int | None, by_compute: bool = False,
              own: dict | None = None, replicas: bool = False) -> list[str]:
        """`spill status`'s lines: a rank a line (rank, host, layers as split by bytes or `by_compute` or every layer
        where `replicas`, pid; its
        working set, budget and pass time: `figures`), then the ranks lost. `own`: rank 0's memory.describe."""
        if self.ranks == 1:
            return []
        n = self.size
        try:
            from spill.stages.split import host_capacity, stage_ranges
            from spill.streamer.plan import load_plan
            capacity = host_capacity(own["budget"], [h.row() for h in self.memories],
                                     n) if own else None   # each host's budget, as the streamer splits the layers
            shares = stage_ranges(load_plan(folder), n, by_compute, capacity) if folder else None
        except (SpillError, OSError):
            shares = None
        out = []
        for rank in range(n):
            pid = streamer_pid if rank == 0 else getattr(self.followers.get(rank), "pid", None)
            span = (f"every layer of {shares[-1].stop}, a replica with a share of the rows" if shares and replicas else
                    f"layers {shares[rank].start}-{shares[rank].stop - 1} of {shares[-1].stop}" if shares
                    else "its layers split when a job names the model")
            out.append(f"stage {rank}: rank {rank} on {self.hosts[rank]}, {span}" + (f", pid {pid}" if pid else "")
                       + ("" if self.alone else self.figures(rank, own)))
        return out + self.lost

    def figures(self, rank: int, own: dict | None) -> str:
        """What a stage line says of its memory and passes: its working set (its last pass's weights and KV), its
        budget (a follower's own, else rank 0's), the link into it as timed at join, and its pass time, the last and
        the median of the last KEPT."""
        p = self.passes[rank][-1] if rank < len(self.passes) and self.passes[rank] else None
        if rank and rank <= len(self.memories):
            h = self.memories[rank - 1]
            budget = f"budget {format_size(int(h.working_set * h.budget_fraction))}" + (
                f", link from rank {rank - 1} {h.latency_s * 1e3:.2g} ms and {format_size(h.bandwidth)}/s"
                if h.bandwidth else "")
        else:
            budget = f"budget {format_size(own['budget'])}" + (" (rank 0's)" if rank else "") if own else ""
        said = [f"working set {format_size(p.weights + p.kv)} (weights {format_size(p.weights)}, KV "
                f"{format_size(p.kv)})"] if p else []
        said += [budget] if budget else []
        if p is None:
            return "; " + ", ".join(said + ["no pass yet"])
        median = statistics.median(q.seconds for q in self.passes[rank])
        return (f"; {', '.join(said)}; pass {_s(p.seconds)} (compute {_s(p.compute_s)}, blocked on a neighbour "
                f"{_s(p.link_s)}), median {_s(median)} of the last {len(self.passes[rank])}")

    def stop(self, timeout: float = 5.0) -> None:
        """End the followers."""
        end(self.followers.values(), self._pipes, timeout)
        self._pipes.clear()
        self.followers.clear()


def end(procs, pipes, timeout: float) -> None:
    """Children watching their parent's pipes: the pipes closed (each child sees EOF and leaves), any still there
    after `timeout` seconds killed."""
    for fd in pipes:
        os.close(fd)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _s(seconds: float) -> str:
    return f"{seconds:.3g} s"


def _cause(why: str) -> str:
    """What a streamer's StageLost says happened, in a few words."""
    if "took over" in why:
        return "it did not answer within SPILL_STAGE_TIMEOUT"
    return "rank 0 lost its link to it" if why else "it was lost"
