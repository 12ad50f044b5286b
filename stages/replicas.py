"""Replicas: every rank holds the whole model and runs a share of the rows, a plan a pass.

Where the whole model fits each host's budget with its share of the rows' KV, N replicas beat a pipeline of N
stages: no micro-batch takes a stage's weights through memory again, no pipeline fills and drains, no hidden
states cross between hosts; only the plan goes out and each replica's tokens come back. The advisor chooses
(admission/advisor.py). Rank 0 owns the row -> rank map: a new row goes to the rank with the fewest running
rows of its width (then the fewest in all, then the lowest rank); its KV lives there alone until it leaves.

    rank 0           the plan and each new row's rank ("share") round the ring; its own rows' pass; each
                     follower's pass (`collect`) merged into one report: every row's tokens, the rows that left
    rank r           the plan's rows whose rank is r (its share of each pool's slots); its pass to rank 0
"""

import dataclasses
import math
import time
from collections import Counter

import msgpack

from spill.streamer.core import PassPlan, PassReport
from spill.streamer.records import Emitted

from . import figures
from .ranked import OnRanks
from .relay import Relay

SUMMED = ("decode_rows", "prefill_tokens", "prefill_groups", "prefill_context")   # a pass's, over its replicas


def share_of(plan: PassPlan, owners: list[int], rank: int, size: int) -> PassPlan:
    """The plan as `rank` runs it: its own new rows, a 1/size share of each reserved pool's slots (rows past it
    take a slot each, as in one process); drops and finishes of rows it does not hold change nothing there."""
    pools = None if plan.pools is None else [[math.ceil(slots / size), width] for slots, width in plan.pools]
    start = [s for s, owner in zip(plan.start, owners) if owner == rank]
    return dataclasses.replace(plan, start=start, pools=pools, drafts={})


class Replicas(OnRanks):
    """This rank's replica of the model in `folder` (every layer). Rank 0 drives (`run`), the others follow."""

    PASS = "share"

    def __init__(self, folder, relay: Relay, **kw):
        self.owners: dict = {}   # rank 0: each running row -> (its rank, its width)
        super().__init__(folder, relay, **kw)
        self._load(folder, kw, replicas=True)

    def run(self, plan: PassPlan) -> PassReport:
        """Rank 0: the plan's pass on every replica, as one report."""
        t0, waited = time.perf_counter(), self.relay.waited
        owners = self._assign(plan)
        self._tell("share", (plan, owners))
        report = super().run(share_of(plan, owners, 0, self.size))
        self.followers = []
        for body in map(msgpack.unpackb, self.relay.collect(None)):
            self._merge(report, body)
        report.link_s = self.relay.waited - waited   # waiting for the replicas slower than this one
        report.seconds = time.perf_counter() - t0
        for rid in [*report.left, *report.preempted]:
            self.owners.pop(rid, None)
        return report

    def clear(self) -> None:
        self.owners = {}   # a reset drops every row: none holds a rank
        super().clear()

    def _assign(self, plan: PassPlan) -> list[int]:
        """Each new row's rank: the fewest running rows of its width, then the fewest in all, then the lowest."""
        ranks = range(self.size)
        alike, all_ = Counter(self.owners.values()), Counter(r for r, _ in self.owners.values())
        out = []
        for row, _ in plan.start:
            rank = min(ranks, key=lambda k: (alike[k, row.width], all_[k], k))
            self.owners[row.id] = (rank, row.width)
            alike[rank, row.width] += 1
            all_[rank] += 1
            out.append(rank)
        return out

    def _merge(self, report: PassReport, body: dict) -> None:
        report.emitted += [Emitted(row, token, finish, position=position) for row, token, finish, position in body["emitted"]]
        report.left += body["left"]
        report.preempted += body["preempted"]
        self.refused += [tuple(r) for r in body["refused"]]
        for key in SUMMED:
            setattr(report, key, getattr(report, key) + body[key])
        self.followers.append(body["figures"])

    def _follow_pass(self, body) -> PassReport:
        """Ranks 1..N-1: this rank's share of rank 0's plan; its pass to rank 0."""
        plan, owners = body
        t0, waited = time.perf_counter(), self.relay.waited
        report = super().run(share_of(plan, owners, self.rank, self.size))
        report.link_s = self.relay.waited - waited
        refused, self.refused = self.refused, []
        self.relay.collect(msgpack.packb({
            "emitted": [[e.row_id, e.token, e.finish, e.position] for e in report.emitted], "left": report.left,
            "preempted": report.preempted, "refused": [list(r) for r in refused],
            "figures": figures.own_pass(self, report).tolist(), **{k: getattr(report, k) for k in SUMMED}}))
        report.seconds = time.perf_counter() - t0
        return report
