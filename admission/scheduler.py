"""The scheduler: the one owner of every row's life, queued to finished. Pure: no sockets, no model.

Each pass it decides everything the streamer does and hands it over as one plan; the streamer runs
exactly that and reports facts (the rows that ended by EOS or max_tokens, live memory, time):

    plan k     rows to start (each with its pool and its prefill group), every prefilling group's chunk,
               rows to drop (preempted) or finish (a stop string), every pool's shape
    report k   rows ended, live memory              -> plan k+1

    a row:     WAITING -> PREFILLING (its group's columns done) -> DECODING -> FINISHED
               preempted: back to the head of the queue, WAITING, with the rest of its prefill group

The memory half (pools, the budget's lines, which rows may start) is the BudgetPolicy's (policy.py).
The admission actor drives this class with real reports; the estimate (simulate.py) with the pass model.
"""

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from spill.streamer.shares import bucket, chunk_for
from spill.typed import AUTO_DRAFTS

from . import drafts, schedule
from .passmodel import PassShape
from .policy import BudgetPolicy, Waiting


class Status(IntEnum):
    WAITING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3


@dataclass
class Prefill:
    """A prefill group: prompts left-padded to one width, advancing together a chunk a pass."""
    rows: list[int]
    width: int
    done: int = 0              # prompt columns computed


@dataclass
class Planned:
    """One pass as decided: what the plan message carries, and the shape the pass model prices."""
    index: int
    start: list[tuple[Waiting, int]] = field(default_factory=list)   # (row, the prefill group it opens)
    chunks: dict[int, int] = field(default_factory=dict)             # prefill group -> prompt columns this pass
    drop: list[int] = field(default_factory=list)
    finish: list[int] = field(default_factory=list)
    pools: list[list[int]] = field(default_factory=list)
    drafts: dict[int, int] = field(default_factory=dict)            # decode row -> the most drafts it may carry
    rounds: int = 1                                                  # decode steps a resident pipeline may run
    pace: int = 0                                                    # prompt tokens the pass could carry
    shape: PassShape = field(default_factory=lambda: PassShape(0, 0, 0, 0))


def fixed_pace(tokens: int):
    """A pace that is always `tokens` (no pass model)."""
    return lambda *_: tokens


def cut(groups: list[list], m: int) -> list[list]:
    """Each group as min(m, its rows) groups of consecutive rows, their sizes within one: a pipeline stage runs a
    prefill group as one micro-batch, so a group cut in m crosses the stages as m, each stage busy beside the next."""
    return [g[round(len(g) * j / k):round(len(g) * (j + 1) / k)] for g in groups for k in [min(max(m, 1), len(g))]
            for j in range(k)]


class Scheduler:
    def __init__(self, policy: BudgetPolicy, pace=None, chunk: int = 512, bytes_streamed: int = 0, speculate: int = 0,
                 model=lambda: None, drafter=lambda: None, priors=None, rounds: int = 1, cut: int = 1):
        self.policy = policy
        self.rounds = rounds                  # decode steps a pass of decode rows alone may run (a resident pipeline's)
        self.cut = cut                        # prefill groups a new group becomes (a resident pipeline's micro-batches)
        self.speculate = speculate            # drafts a decode row may carry a pass (--speculate K); 0: none; -1: auto
        self.model = model                    # () -> the pass model auto drafts by (None: uncalibrated)
        self.drafter = drafter                # () -> what a draft model's steps cost (drafter.DraftCost; None: lookup)
        self.priors = priors                  # (decode rows) -> each one's acceptance before its drafts (None: PRIOR)
        self.hits: dict[int, float] = {}      # a row's decayed drafts accepted and drafts tried (drafts.observe)
        self.tried: dict[int, float] = {}
        self.whole: dict[int, list[int]] = {}   # a row's drafts accepted and tried over its life (ended: `reported`)
        self.pace = pace or fixed_pace(policy.priced_prefill)   # (rows, context, need, offset, most, empty) -> tokens
        self.chunk = chunk
        self.bytes_streamed = bytes_streamed
        self.status: dict[int, Status] = {}
        self.context: dict[int, int] = {}     # a decoding row's tokens of KV; a row's tokens generated
        self.generated: dict[int, int] = {}
        self.groups: dict[int, Prefill] = {}
        self.group_of: dict[int, int] = {}
        self.stops: list[int] = []            # rows ended by a stop string: the next plan finishes them
        self.deferred: list[Waiting] = []     # admitted (a slot each) but waiting for room for their prompt's KV
        self.index = 0
        self.opened = 0                       # prefill groups opened in this epoch
        self.returned = 0                     # rows preempted since the last report (the coordinator's figure)

    # -- rows in, and what ends them -----------------------------------------------------------------------
    def offer(self, rows: list[Waiting]) -> list[tuple[Waiting, str]]:
        """Queue rows; those that can never fit come back with their sentence (and are finished)."""
        refused = self.policy.offer(rows)
        for w in rows:
            self.status[w.row] = Status.WAITING
        for w, _ in refused:
            self.status[w.row] = Status.FINISHED
        return refused

    def ended(self, rows: list[int]) -> None:
        """Rows the streamer reports ended (EOS, max_tokens, refused): finished."""
        for row in rows:
            self._finish(row)

    def stopped(self, rows: list[int]) -> None:
        """Rows the tokenizer ended on a stop string: finished wherever they are (running, or queued again
        after a preemption: never regenerated); the next plan frees any slot they hold."""
        for row in rows:
            if self.status.get(row, Status.FINISHED) != Status.FINISHED:
                self.stops.append(row)
                self._finish(row)

    def _finish(self, row: int) -> None:
        if self.status.get(row) is None or self.status[row] == Status.FINISHED:
            return
        if self.status[row] == Status.WAITING:   # queued, queued again after a preemption, or deferred
            self.policy.queue = type(self.policy.queue)(w for w in self.policy.queue if w.row != row)
            self.deferred = [w for w in self.deferred if w.row != row]
        self.status[row] = Status.FINISHED
        self.policy.finished([row])
        self.context.pop(row, None)
        self.hits.pop(row, None)
        self.tried.pop(row, None)
        self.whole.pop(row, None)
        self._leave_group(row)

    def _leave_group(self, row: int) -> None:
        g = self.group_of.pop(row, None)
        if g is not None and g in self.groups:
            self.groups[g].rows.remove(row)
            if not self.groups[g].rows:
                del self.groups[g]

    def prompts(self, rows) -> dict[int, int]:
        """{row: prompt tokens} of those of `rows` still running: the tiers a pass report's drafts count in."""
        running = self.policy.running
        return {int(r): len(running[int(r)].prompt) for r in rows if int(r) in running}

    def started(self) -> int:
        """Rows prefilling or decoding."""
        return sum(self.status[r] in (Status.PREFILLING, Status.DECODING) for r in self.policy.running)

    @property
    def busy(self) -> bool:
        """Rows wait or run: a plan has work to do."""
        return bool(self.policy.queue or self.policy.running or self.stops)

    # -- each pass -----------------------------------------------------------------------------------------
    def plan(self) -> Planned:
        """The next pass: preemptions above the hard line, the pace, the rows that start within it and
        the prefill KV they allocate, each group's chunk; then the rows' state as the pass leaves it."""
        p = self.policy
        out = Planned(self.index, finish=self.stops)
        self.stops = []
        # 1. above the hard line: the newest rows go, each with the rest of its prefill group
        out.drop = self._mates(p.to_preempt())
        for row in out.drop:
            self._leave_group(row)
            self.status[row], self.context[row] = Status.WAITING, 0
        self.deferred = [w for w in self.deferred if w.row not in out.drop]
        # 2. the pace, and the rows that start within what the groups still prefilling leave of it
        decoding = [r for r in p.running if self.status[r] == Status.DECODING and r not in out.drop]
        offsets = [g.done for g in self.groups.values() for _ in g.rows]
        out.pace = self.pace(len(decoding), sum(self.context[r] for r in decoding), schedule.need(p),
                             schedule.cached(offsets), p.priced_prefill, schedule.empty(p))
        left = schedule.outstanding([g.width - g.done for g in self.groups.values() for _ in g.rows], out.pace,
                                    self.chunk)
        admitted = schedule.admit(p, out.pace - left, bool(self.groups))
        if out.drop:
            p.preempted(out.drop)       # back to the head of the queue, after this plan's admissions
            self.returned += len(out.drop)
        for w in [w for w in admitted if w.cached]:   # the live estimate's running rows: their prompt is in KV
            self.status[w.row], self.context[w.row], self.generated[w.row] = Status.DECODING, w.cached, 0
            decoding.append(w.row)
        fresh = [w for w in admitted if not w.cached]
        for rows in cut(self._priced(bucket(self.deferred, length=lambda w: len(w.prompt)) +
                                     bucket(fresh, length=lambda w: len(w.prompt))), self.cut):
            self.opened += 1
            self.groups[self.opened] = Prefill([w.row for w in rows], max(len(w.prompt) for w in rows))
            for w in rows:
                out.start.append((w, self.opened))
                self.group_of[w.row], self.status[w.row], self.generated[w.row] = self.opened, Status.PREFILLING, 0
        out.pools = p.shapes()
        # 3. each group's chunk: an equal share of the pace for every prefilling row
        step = chunk_for(out.pace, sum(len(g.rows) for g in self.groups.values()), self.chunk)
        out.chunks = {k: min(step, g.width - g.done) for k, g in self.groups.items()}
        out.shape = self._shape(decoding, out.chunks)
        out.drafts = self._drafts(decoding, out.shape)
        out.rounds = self._rounds(decoding, out)
        self._advance(decoding, out.chunks)
        self.index += 1
        return out

    def _mates(self, rows: list[int]) -> list[int]:
        """`rows` and every other row of a prefill group one of them is in, in admission order."""
        groups = {self.group_of[r] for r in rows if r in self.group_of}
        more = {r for g in groups for r in self.groups[g].rows}
        return [r for r in self.policy.running if r in more or r in rows]

    def _priced(self, groups: list[list[Waiting]]) -> list[list[Waiting]]:
        """The groups (those deferred first) whose prompts' KV fits beside what is reserved: what Group.prefill
        allocates, at its padded width; of a group that does not, the rows that fit. The rest are deferred:
        they keep their slots and start first once they fit. With nothing else running or prefilling, the
        first row starts whatever its prompt (`offer` refused a row that never fits)."""
        p, s = self.policy, self.policy.sheet
        room = s.fixed.get("prefill_kv", 0) + max(s.kv_budget - p.reserved(), 0)
        room -= sum(s.prefill_kv([g.width] * len(g.rows)) for g in self.groups.values())
        alone = not self.groups and len(p.running) == sum(len(g) for g in groups)
        out, self.deferred = [], []
        for rows in groups:
            n = len(rows) if not self.deferred else 0      # after a deferred row, every row waits: rows keep order
            while n and s.prefill_kv([len(w.prompt) for w in rows[:n]]) > room and not (alone and not out):
                n -= 1
            if alone and not out and not n:
                n = 1
            if n:
                out.append(rows[:n])
                room -= s.prefill_kv([len(w.prompt) for w in rows[:n]])
            self.deferred += rows[n:]
        return out

    def _shape(self, decoding: list[int], chunks: dict[int, int]) -> PassShape:
        """What the pass carries, as the pass model prices it (padding included, as the streamer computes it)."""
        prefill = sum(len(self.groups[k].rows) * n for k, n in chunks.items())
        keys = sum(len(self.groups[k].rows) * n * (self.groups[k].done + n) for k, n in chunks.items())
        return PassShape(len(decoding), prefill, sum(self.context[r] for r in decoding), self.bytes_streamed,
                         prefill_groups=len(chunks), prefill_context=keys)

    def _drafts(self, decoding: list[int], shape: PassShape) -> dict[int, int]:
        """Each decode row's draft bound: --speculate's K, or auto's choice from the rows' acceptance and the pass
        model; never past the row's max_tokens."""
        if not self.speculate or not decoding:
            return {}
        left = [self.policy.running[r].max_tokens - self.generated[r] for r in decoding]
        prior = self.priors(decoding) if self.priors is not None else drafts.PRIOR
        rates = drafts.rate([self.hits.get(r, 0.0) for r in decoding], [self.tried.get(r, 0.0) for r in decoding], prior)
        k = drafts.counts("auto" if self.speculate == AUTO_DRAFTS else self.speculate, self.model(), shape,
                          [self.context[r] for r in decoding], rates, left, self.drafter())
        return {r: int(n) for r, n in zip(decoding, k) if n > 0}

    def _rounds(self, decoding: list[int], out: Planned) -> int:
        """A pass of decode rows alone may run several steps (`self.rounds`, a resident pipeline's), none past the
        most tokens a row has left; where rows wait, none past the fewest, so that no slot idles while they do."""
        if self.rounds <= 1 or not decoding or out.start or out.chunks or out.drop or out.drafts or self.groups:
            return 1
        left = [self.policy.running[r].max_tokens - self.generated[r] for r in decoding]
        return max(1, min(self.rounds, min(left) if self.policy.queue else max(left)))

    def _advance(self, decoding: list[int], chunks: dict[int, int]) -> None:
        """The rows' state as the pass leaves it: a token more for every decoding row; a group that ends its
        prompt samples each row's first token and its rows decode from the next pass on."""
        for r in decoding:
            self.context[r] += 1
            self.generated[r] += 1
        for k, n in chunks.items():
            g = self.groups[k]
            g.done += n
            if g.done >= g.width:
                for r in g.rows:
                    w = self.policy.running[r]
                    self.status[r], self.context[r], self.generated[r] = Status.DECODING, len(w.prompt) + 1, 1
                    self.group_of.pop(r, None)
                del self.groups[k]

    def reported(self, finished: list[int], live: int | None = None, accepted=(), drafted=(), rounds: int = 1) -> list:
        """A pass report: the rows it ended, live memory (None: the estimate's, which holds no memory),
        [row, drafts accepted] of rows that took more than the one token `_advance` counted, [row, drafts
        carried] of rows that drafted (their acceptance, which auto drafts by), and the decode steps it ran.
        Returns the ended rows that drafted and ran their whole max_tokens (as the estimate prices every row; one that
        ended early sets no job's tail): (prompt tokens, drafts accepted, tried) each, over its life."""
        took = dict((int(r), int(n)) for r, n in accepted)
        if rounds > 1:   # every row still decoding took a token a step
            took = {r: rounds - 1 for r, s in self.status.items() if s == Status.DECODING}
        for row, n in took.items():
            if self.status.get(row) == Status.DECODING:
                self.context[row] += n
                self.generated[row] += n
        if len(drafted):
            rows = [int(r) for r, _ in drafted]
            hits, tried = drafts.observe(np.array([self.hits.get(r, 0.0) for r in rows]),
                                         np.array([self.tried.get(r, 0.0) for r in rows]),
                                         [n for _, n in drafted], [took.get(r, 0) for r in rows])
            for r, h, t, n in zip(rows, hits.tolist(), tried.tolist(), (n for _, n in drafted)):
                if self.status.get(r) == Status.DECODING:
                    self.hits[r], self.tried[r] = h, t
                    whole, a = self.whole.setdefault(r, [0, 0]), took.get(r, 0)
                    whole[0], whole[1] = whole[0] + a, whole[1] + a + (a < int(n))
        running = self.policy.running
        lives = [(len(running[r].prompt), *self.whole[r]) for r in map(int, finished)
                 if r in self.whole and r in running and self.generated[r] >= running[r].max_tokens]
        self.ended(finished)
        if live is not None:
            self.policy.observe(live)
        return lives

    def clear(self) -> None:
        self.policy.clear()
        self.status, self.context, self.generated, self.groups, self.group_of = {}, {}, {}, {}, {}
        self.hits, self.tried, self.whole = {}, {}, {}
        self.stops, self.deferred, self.index, self.opened, self.returned = [], [], 0, 0, 0
