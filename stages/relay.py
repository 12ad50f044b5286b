"""A rank's sends and receives over the pipeline group, each with a deadline.

Receives run on a thread of their own and sends on another (each with an MLX stream of its own: MLX's streams
belong to a thread), so a send going out never holds up the next receive or the compute beside it, and a
neighbour that died is a `StageLost` at once (MLX's ring says the connection was lost) and one that stopped
answering is one after `deadline_s`, never a hang. MLX's ring sends only between neighbours, so messages
go round the ring: a plan from rank 0 rank by rank to the last (`plan`), hidden states r -> r+1, the last
rank's tokens to rank 0 and on to the others (`tokens`), each follower's figures to rank 0 (`gather`: its memory
at join, `hosts`; a pass's figures, `figures`), a replica's pass to rank 0 (`collect`). `waited` counts the
seconds the caller spent blocked on its neighbours (a pass's bubble), a follower's wait for the next plan left out.

MLX's ring receive spins (a core while it waits), so a follower waits for the next plan on a doorbell instead: a
plain TCP link from the rank before it (the one the plan comes from), rung with a byte before each plan goes on
round the ring. It sleeps in a blocking read until then, and the link closing says that rank died (`plan`).
"""

import json
import os
import queue
import socket
import threading
import time

import mlx.core as mx
import msgpack
import numpy as np

from spill import config
from spill.errors import RankLost, SpillError

from . import figures as figures_of
from .link import join, measure


class StageLost(RankLost):
    """The group lost a rank (it died, or missed a deadline): the group's epoch ends and it starts anew."""


def _address(rank: int) -> str | None:
    """"10.0.0.3:5002": rank `rank`'s first ring address in MLX_HOSTFILE (the ring's JSON list of each rank's)."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            return str(json.load(f)[rank][0])
    except (KeyError, OSError, ValueError, IndexError, TypeError):
        return None


def peer_name(rank: int) -> str:
    """"rank 2 (10.0.0.3:5002)" where MLX_HOSTFILE names it."""
    address = _address(rank)
    return f"rank {rank} ({address})" if address else f"rank {rank}"


def host_of(rank: int) -> str:
    """The host rank `rank`'s ring listens on ("10.0.0.3", "::1"), as MLX_HOSTFILE names it."""
    address = _address(rank)
    if address is None or ":" not in address:
        raise SpillError(f"MLX_HOSTFILE names no \"ip:port\" for rank {rank} (found {address!r}); start every rank "
                         "with mlx.launch --backend ring, or set MLX_RANK and MLX_HOSTFILE")
    return address.rsplit(":", 1)[0].strip("[]")


def group_relay() -> "Relay | None":
    """This process's relay where `mlx.launch` (or `launch.spawn`) made it one of several ranks (MLX_RANK,
    MLX_HOSTFILE), waiting SPILL_STAGE_TIMEOUT on a neighbour; None where it runs alone."""
    if "MLX_RANK" not in os.environ and "MLX_HOSTFILE" not in os.environ:
        return None
    group = join()
    return Relay(group, config.stage_timeout()) if group.size() > 1 else None


class Relay:
    def __init__(self, group, deadline_s: float, memory: dict | None = None):
        """`memory`: a follower's memory arguments (`memory.memory_args`), told to rank 0 at join (`hosts`)."""
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.deadline_s = deadline_s
        self.waited = 0.0   # seconds blocked on a neighbour so far
        self._in, self._out = queue.Queue(), queue.Queue()   # receives; sends, in order
        self._sending: list = []   # sends posted and not yet waited for (`flush`)
        self._lost: StageLost | None = None   # once lost, every later call raises it: the thread may be stuck
        for jobs, name in ((self._in, "spill-relay"), (self._out, "spill-relay-out")):
            threading.Thread(target=self._work, args=(jobs,), name=name, daemon=True).start()
        self._pass: tuple | None = None   # rank 0: the receive of the followers' figures of the last pass
        mine = figures_of.own_memory(memory or {}) if self.rank else None
        told = [figures_of.memory_of(row) for row in self._gathered(mine, len(figures_of.MEMORY))]
        # rank 0: each follower's (working set, budget fraction), told at join, and the link into it from the rank
        # before (latency s, bandwidth bytes/s), timed at join; [] elsewhere and alone
        self.hosts = [(*h, hop.latency_s, hop.bandwidth) for h, hop in zip(told, self._links())]
        self._bell_in, self._bell_out = self._doorbells()   # from the rank before, to the rank after

    def _links(self) -> list:
        """Every hop r -> r+1 timed (`link.measure`: the same list on every rank, each rank's sends gone out)."""
        if self.size == 1:
            return []
        try:
            return measure(self.group)
        except RuntimeError as err:   # MLX's ring lost a neighbour
            raise self._failed("timing the links with", (self.rank + 1) % self.size, err) from None

    def _doorbells(self) -> tuple:
        """This rank's doorbell links (None where it has no rank before or after): each rank listens on its ring
        host, tells the rank after its port round the ring, and that rank connects."""
        server = bell_in = bell_out = None
        try:
            if self.rank + 1 < self.size:
                host = host_of(self.rank)
                server = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
                server.settimeout(self.deadline_s)
                self.send(mx.array([server.getsockname()[1]], dtype=mx.int32), self.rank + 1)
            if self.rank > 0:
                port = int(self.recv((1,), mx.int32, self.rank - 1, "waiting for the doorbell of").item())
                bell_in = self._bell(lambda: socket.create_connection((host_of(self.rank - 1), port),
                                                                      self.deadline_s), self.rank - 1)
            if server is not None:
                bell_out = self._bell(lambda: server.accept()[0], self.rank + 1)
        finally:
            if server is not None:
                server.close()
        return bell_in, bell_out

    def _bell(self, connect, peer: int) -> socket.socket:
        """A doorbell link `connect()` made: blocking, each byte sent at once (no wait for the last one's ack)."""
        try:
            link = connect()
        except OSError as err:
            raise self._failed("joining the doorbell of", peer, err) from None
        link.settimeout(None)
        link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return link

    def _work(self, jobs: queue.Queue) -> None:
        stream = mx.new_stream(mx.cpu)
        while (job := jobs.get()) is not None:
            fn, box, done = job
            try:
                box["out"] = fn(stream)
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread, which raises it
                box["err"] = err
            finally:
                done.set()

    def _post(self, jobs: queue.Queue, fn, peer: int, what: str) -> tuple:
        if self._lost is not None:
            raise self._lost
        box, done = {}, threading.Event()
        jobs.put((fn, box, done))
        return box, done, peer, what

    def take(self, posted: tuple, deadline: float | None = -1.0):
        """What a posted job gave, once it is done (within `deadline` seconds; -1: the relay's, None: no limit)."""
        box, done, peer, what = posted
        deadline = self.deadline_s if deadline == -1.0 else deadline
        t0 = time.perf_counter()
        finished = done.wait(deadline)
        if deadline is not None:   # a wait for the next plan is no pass's
            self.waited += time.perf_counter() - t0
        if self._lost is not None:
            raise self._lost
        if not finished:
            self._lost = StageLost(f"the pipeline group lost a rank: {what} {peer_name(peer)} took over {deadline:g} s; "
                                   "a rank stopped answering (SPILL_STAGE_TIMEOUT sets the wait), start the group anew",
                                   peer)
        elif "err" in box:
            self._failed(what, peer, box["err"])
        if self._lost is not None:
            raise self._lost
        return box.get("out")

    def _failed(self, what: str, peer: int, err) -> StageLost:
        """The group's end where `what` `peer` failed with `err`: every later call raises it."""
        self._lost = StageLost(f"the pipeline group lost a rank: {what} {peer_name(peer)} failed "
                               f"({' '.join(str(err).split())}); a rank died or its host dropped off, "
                               "start the group anew", peer)
        return self._lost

    def send(self, x: mx.array, peer: int, what: str = "sending to", wait: bool = True) -> None:
        """`x` to `peer`; `wait` False: it goes out beside what the caller does next (`flush` waits for it)."""
        mx.eval(x)   # computed here: the relay's thread runs only the send
        posted = self._post(self._out, lambda s: mx.eval(mx.distributed.send(x, peer, group=self.group, stream=s)),
                            peer, what)
        if wait:
            self.take(posted)
        else:
            self._sending.append(posted)

    def flush(self) -> None:
        """Every send posted without waiting, gone out."""
        sending, self._sending = self._sending, []
        for posted in sending:
            self.take(posted)

    def recv_later(self, shape: tuple, dtype: mx.Dtype, peer: int, what: str) -> tuple:
        """A receive from `peer` posted now, taken with `take` (receives run in the order posted)."""
        def fn(stream):
            x = mx.distributed.recv(shape, dtype, peer, group=self.group, stream=stream)
            mx.eval(x)
            return x
        return self._post(self._in, fn, peer, what)

    def recv(self, shape: tuple, dtype: mx.Dtype, peer: int, what: str, wait: bool = True) -> mx.array:
        """An array from `peer`; `wait` False: for as long as it takes (a stage waiting for work)."""
        return self.take(self.recv_later(shape, dtype, peer, what), -1.0 if wait else None)

    def plan(self, data: bytes | None = None) -> bytes:
        """Rank 0's `data` on every rank, round the ring. The others wait for it as long as it takes, asleep on
        their doorbell (a group between jobs has no plan to run)."""
        if self.rank > 0:
            self._doorbell()
            data = self._bytes_from(self.rank - 1, "a plan from", wait=False)
        if self.rank + 1 < self.size:
            self._ring()
            self._bytes_to(data, self.rank + 1)
        return data

    def _doorbell(self) -> None:
        """A follower: asleep until the rank before rings (a plan follows); its link closed: that rank died."""
        if self._lost is not None:
            raise self._lost
        try:
            rung = self._bell_in.recv(1)
        except OSError as err:
            raise self._failed("waiting for a plan from", self.rank - 1, err) from None
        if not rung:
            raise self._failed("waiting for a plan from", self.rank - 1, "its doorbell link closed")

    def _ring(self) -> None:
        """The rank after's doorbell, rung before its plan goes out."""
        if self._lost is not None:
            raise self._lost
        try:
            self._bell_out.sendall(b"\x01")
        except OSError as err:
            raise self._failed("ringing", self.rank + 1, err) from None

    def collect(self, mine: bytes | None) -> list[bytes]:
        """Each follower's `mine` on rank 0, round the ring (a msgpack list grown rank by rank, the last's to rank 0):
        rank 0 gets rank 1's first; [] elsewhere."""
        if self.size == 1:
            return []
        if self.rank == 0:
            return msgpack.unpackb(self._bytes_from(self.size - 1, "reports from"))
        before = msgpack.unpackb(self._bytes_from(self.rank - 1, "reports from")) if self.rank > 1 else []
        self._bytes_to(msgpack.packb([*before, mine]), (self.rank + 1) % self.size)
        return []

    def _bytes_from(self, peer: int, what: str, wait: bool = True) -> bytes:
        """Bytes `_bytes_to` sent: their length (int32), then the bytes (uint8)."""
        n = int(self.recv((1,), mx.int32, peer, f"waiting for {what}", wait=wait).item())
        return bytes(np.array(self.recv((n,), mx.uint8, peer, f"receiving {what}"), copy=False))

    def _bytes_to(self, data: bytes, peer: int) -> None:
        self.send(mx.array([len(data)], dtype=mx.int32), peer)
        self.send(mx.array(np.frombuffer(data, dtype=np.uint8)), peer)

    def tokens(self, tokens: np.ndarray | None, count: int) -> np.ndarray:
        """The last rank's `count` tokens (int32) on every rank: it sends them to rank 0, which sends them on."""
        last = self.size - 1
        if self.rank == last:
            self.send(mx.array(tokens.astype(np.int32)), 0)
            return tokens
        got = self.recv((count,), mx.int32, (self.rank - 1) % self.size, "waiting for tokens from")
        if self.rank + 1 < last:
            self.send(got, self.rank + 1)
        return np.array(got)

    def down(self, tokens: np.ndarray | None, count: int) -> np.ndarray:
        """Rank 0's `count` tokens (int32) on ranks 1..N-2 (the last has them: it drew them), sent on rank by rank."""
        if self.rank > 0:
            tokens = np.array(self.recv((count,), mx.int32, self.rank - 1, "waiting for tokens from"))
        if self.rank + 1 < self.size - 1:
            self.send(mx.array(tokens.astype(np.int32)), self.rank + 1)
        return tokens

    def gather(self, mine: np.ndarray | None, width: int) -> tuple | None:
        """Each follower's `width` int64 figures to rank 0, round the ring: follower r takes 1..r-1's from r-1 and
        sends them on with its own (the last to rank 0). Rank 0: the receive, posted (`take`: [size - 1 x width])."""
        if self.rank == 0:
            return self.recv_later(((self.size - 1) * width,), mx.int64, self.size - 1, "waiting for figures from")
        before = self.recv(((self.rank - 1) * width,), mx.int64, self.rank - 1, "waiting for figures from") \
            if self.rank > 1 else mx.zeros((0,), mx.int64)
        self.send(mx.concatenate([before, mx.array(mine.astype(np.int64))]), (self.rank + 1) % self.size)
        return None

    def _gathered(self, mine: np.ndarray | None, width: int) -> list:
        """Rank 0: each follower's figures (`gather`), a row each; [] elsewhere and alone."""
        if self.size == 1:
            return []
        posted = self.gather(mine, width)
        return [] if posted is None else np.array(self.take(posted)).reshape(self.size - 1, width).tolist()

    def figures(self, mine: np.ndarray, now: bool = False) -> list:
        """A pass's figures (figures.PASS) gathered without a wait: followers send theirs; rank 0 takes the pass
        before's (its tokens came after them) and posts the next receive, or takes this pass's `now` (the last of a
        job: nothing waits on it). Rank 0: a row a follower, [] before."""
        if self.size == 1:
            return []
        if self.rank:
            self.gather(mine, len(figures_of.PASS))
            return []
        waited, rows = self.waited, self.settle()
        self._pass = self.gather(None, len(figures_of.PASS))
        rows = self.settle() if now else rows
        self.waited = waited   # no pass's bubble
        return rows

    def settle(self) -> list:
        """Rank 0: the followers' figures of the last pass if their receive is pending, waited for (before they
        are let go: a receive still pending when the process ends aborts it); else []."""
        posted, self._pass = self._pass, None
        return [] if posted is None else np.array(self.take(posted)).reshape(self.size - 1, -1).tolist()

    def close(self) -> None:
        self._in.put(None)
        self._out.put(None)
        for link in (self._bell_in, self._bell_out):
            if link is not None:
                link.close()
