"""The estimate: the admission actor's own scheduler run pass by pass against the pass model on the job's
real token lengths, drain tail included. Pure: a fake clock, no model, no sockets.

Each plan is what the streamer would run (scheduler.py): a row emits its first token in the pass that ends
its prompt and one token a pass after that; it leaves after its last token and its slot is refilled next pass.

Rows whose output length is unknown are priced at max_tokens (`Estimate.at_max_tokens`).

With drafts (`speculate`, the job's --speculate) and this model's measured per-draft acceptance a, a pass
whose plan gives rows drafts is priced as the streamer runs it (`drafts.padded`) and each drafting row takes
each draft with probability a until its first rejection (seeded draws), reported to the scheduler as the
streamer reports them; a is the row's prompt-length tier's where that tier was measured on enough drafts
(calibration.TIERED), else the model's (rows of open questions accept far fewer drafts than copies of a passage).
Without a measured a, drafts are planned (to say whether any would run) but
neither priced nor taken. With a draft model's price (`drafter`, --draft) each drafting pass adds its steps
(drafter.DraftCost), and without a measured a its drafts are priced as none accepted: an upper bound.
"""

from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from spill import config
from spill.stages.model import micro_batches as micro_batches_of, pass_seconds, replica_seconds
from spill.typed import AUTO_DRAFTS

from . import drafts, schedule
from .passmodel import PassModel, PassShape
from .schedule import TIERS, tier_of
from .scheduler import Scheduler, Status


@dataclass
class SimRow:
    row: int
    prompt: int               # prompt tokens
    out: int                  # tokens it will generate (max_tokens when unknown)
    tier: str = ""
    context: int = 0          # a running row's tokens in its KV already (the live ETA): no prefill, at once
    max_tokens: int = 0       # what its slot is priced for, when it is known to end before it (0: out)


@dataclass
class Tier:
    name: str
    rows: int = 0
    prompt_tokens: int = 0
    row_passes: int = 0       # rows of the tier summed over passes: batch = row_passes / passes
    passes: int = 0           # passes that ran at least one of its rows
    seconds: float = 0.0      # its share of each pass it ran in (by rows)
    ideal_seconds: float = 0.0

    @property
    def batch(self) -> float:
        return self.row_passes / self.passes if self.passes else 0.0

    def to_dict(self) -> dict:
        return {"tier": self.name, "rows": self.rows, "prompt_tokens": self.prompt_tokens,
                "batch": round(self.batch, 1), "passes": self.passes, "seconds": round(self.seconds, 3),
                "ideal_seconds": round(self.ideal_seconds, 3)}


@dataclass
class Estimate:
    total_seconds: float
    ideal_seconds: float
    passes: int
    tiers: list[Tier]
    timeline: list[tuple[float, int]] = field(default_factory=list)   # (seconds, rows done), one point a pass
    prefill: list[int] = field(default_factory=list)                  # prefill tokens of each pass
    allowance: list[int] = field(default_factory=list)                # what the pass model allowed it
    running: list[dict] = field(default_factory=list)                 # tier -> rows in each pass
    errors: int = 0           # rows that cannot run (bad lines, too long): counted, not priced
    at_max_tokens: bool = True
    stalled: bool = False     # the policy left rows waiting with nothing running
    mode: str = "streamed"    # or "resident": every pass after the first reads nothing
    shortfall: str | None = None   # why no row can run: the budget cannot hold the model's fixed part
    kv: str = "unquantized"   # the decode pools' KV format priced (shares.kv_format)
    kv_hint: str = ""         # a KV-bound job priced unquantized: what --kv-bits 8 would give
    drafts: dict | None = None   # drafts planned in some pass: speculate, acceptance (None: not priced), tokens a row

    @property
    def rows_per_pass(self) -> float:
        """Running rows in a pass, on average over the passes."""
        return sum(sum(r.values()) for r in self.running) / len(self.running) if self.running else 0.0

    def to_dict(self) -> dict:
        return {"total_seconds": round(self.total_seconds, 3), "ideal_seconds": round(self.ideal_seconds, 3),
                "passes": self.passes, "mode": self.mode, "kv": self.kv, "kv_hint": self.kv_hint or None, "errors": self.errors, "priced_at_max_tokens": self.at_max_tokens, "shortfall": self.shortfall,
                "drafts": self.drafts, "tiers": [t.to_dict() for t in self.tiers]}


def simulate(rows: list[SimRow], policy, waiting, model: PassModel, bytes_streamed: int, *,
             chunk: int = 512, max_batch=None, errors: int = 0, at_max_tokens: bool = True,
             length=schedule.prompt_length, read_once: int = 0, speculate: int = 0,
             acceptance: float | None = None, drafter=None, by_tier: dict | None = None, stages: int = 1,
             micro_batches: int = 0, stage_scale: float = 1.0, replicas: bool = False, hop=None,
             spread: dict | None = None) -> Estimate:
    """The admission actor's scheduler (scheduler.py) run against the pass model: each plan priced by
    `model`, each row ending once it has generated its `out` tokens. `policy`: the BudgetPolicy it plans
    with; `waiting(SimRow)` makes the policy's row record and `length` reads its prompt length back;
    `max_batch(SimRow)` is the largest batch the memory budget fits for rows like it (for the ideal);
    `read_once`: bytes the first pass reads besides `bytes_streamed` (resident: every layer, once);
    `speculate`: the job's drafts (0 off, K, AUTO_DRAFTS), taken at `acceptance` (None: not priced), a row's at its
    prompt-length tier's where `by_tier` ({tier: acceptance}) has it, spread over the tier's rows as its ended rows'
    own acceptance was where `spread` ({tier: sorted rates}, `Calibration.tier_rows`) has it; `drafter`: a draft
    model's price (drafter.DraftCost), whose steps each drafting pass adds; `stages`: a resident pipeline's ranks,
    whose passes run as admission plans them for it (rounds, prompts cut in `micro_batches`, 0: one a stage) and as
    the stage model prices them (stages/model.py `pass_seconds`, each hop priced by `hop`), those that read nothing
    times `stage_scale` (what such passes of this pipeline took over that price, `Calibration.stage_scale`);
    `replicas`: the `stages` ranks each the whole model and a share of the rows, a pass priced as one replica's share
    (`replica_seconds`), times `stage_scale`."""
    by_id = {r.row: r for r in rows}
    tiers: dict[str, Tier] = {}
    for r in rows:
        t = tiers.setdefault(r.tier or tier_of(r.prompt), Tier(r.tier or tier_of(r.prompt)))
        t.rows, t.prompt_tokens = t.rows + 1, t.prompt_tokens + r.prompt

    def pace(n, context, need, offset, most, empty) -> int:
        return schedule.pace(model, bytes_streamed, n, context, need, offset, most, empty)
    spec = _Drafts(by_id, acceptance, drafter, by_tier, spread)
    piped = stages > 1 and not bytes_streamed and not replicas   # a resident pipeline: rounds, prompts cut in M
    m = micro_batches_of(micro_batches, stages)
    sched = Scheduler(policy, pace, chunk, bytes_streamed, speculate, lambda: model, lambda: drafter, spec.priors,
                      config.rounds() if piped else 1, m if piped else 1)
    offered = []
    for r in rows:   # a running row asks the policy for its slot (its full length) and decodes at once
        w = waiting(replace(r, prompt=0, out=r.context + r.out) if r.context else r)
        w.cached = r.context
        offered.append(w)
    refused = sched.offer(offered) or []
    schedule.interleave(policy.queue, length)
    policy.queue = deque(sorted(policy.queue, key=lambda w: not by_id[w.row].context))   # running rows first
    est = Estimate(0.0, 0.0, 0, list(tiers.values()), errors=errors + len(refused), at_max_tokens=at_max_tokens)
    clock, done = 0.0, 0
    while sched.busy:
        planned = sched.plan()
        running = [r for r in policy.running if sched.status[r] in (Status.PREFILLING, Status.DECODING)]
        if not running and not planned.drop:
            est.stalled = True   # rows wait with nothing running: none fits the budget
            break
        shape = replace(planned.shape, bytes_streamed=bytes_streamed + (0 if est.passes else read_once))
        took, drafted = spec.take(sched, planned)
        if drafted:   # every decode row feeds 1 + the most drafts
            shape = drafts.padded(shape, 1 + max(k for _, k in drafted))
        scale = 1.0 if shape.bytes_streamed else stage_scale
        seconds = (pass_seconds(model, shape, stages, m, planned.rounds, hop) * scale if piped else
                   replica_seconds(model, shape, stages) * scale if replicas and stages > 1 else model.pass_s(shape)
                   ) + spec.steps_s(sched, drafted)
        clock += seconds
        est.running.append(_share(tiers, by_id, running, seconds))
        finished = [r for r in running if sched.status[r] == Status.DECODING
                    and sched.generated[r] + took.get(r, 0) + planned.rounds - 1 >= by_id[r].out]
        sched.reported(finished, None, [[r, n] for r, n in took.items() if n], drafted, planned.rounds)
        done += len(finished)
        est.passes += 1
        est.timeline.append((clock, done))
        est.prefill.append(shape.prefill_tokens)
        est.allowance.append(planned.pace)
    est.total_seconds = clock
    est.ideal_seconds = _ideal(est.tiers, rows, model, bytes_streamed, max_batch)
    if speculate and spec.passes:
        est.drafts = {"speculate": "auto" if speculate == AUTO_DRAFTS else speculate,
                      "acceptance": None if acceptance is None else round(acceptance, 3),
                      **({"tiers": {t: round(spec.used[t], 3) for t in TIERS if t in spec.used}} if spec.used else {}),
                      "passes": spec.passes, "tokens_per_decode_row": round(1 + spec.accepted / max(spec.rows, 1), 3),
                      **({"draft_s": round(spec.draft_s / max(spec.drafting, 1), 3)} if drafter is not None else {})}
    return est


class _Drafts:
    """The drafts simulated passes take: each of a row's drafts accepted with probability its acceptance (its
    prompt-length tier's in `tiers`, else `acceptance`) until the first rejection, as verification takes them, drawn
    from a seeded generator (the same estimate every time). Draws, not expectations: a row's rate rises or falls as a
    running row's does, so auto drafts as in a job, each row starting where the live scheduler starts it. Where a
    tier's rows' own acceptance was measured (`spread`), its rows here take those rates, each rate to as many rows
    (in a seeded order), so the job's tail runs at its slowest rows' pace, as in a job."""

    def __init__(self, by_id: dict[int, SimRow], acceptance: float | None, drafter=None, tiers: dict | None = None,
                 spread: dict | None = None):
        self.by_id, self.acceptance, self.drafter, self.tiers = by_id, acceptance, drafter, tiers or {}
        self.own: dict[int, float] = {}               # a row's own acceptance, from its tier's spread
        order = np.random.default_rng(1)
        for name, rates in (spread or {}).items():
            mine = [r for r in by_id if tier_of(by_id[r].prompt) == name]
            for j, r in zip(order.permutation(len(mine)), mine):
                self.own[r] = rates[min(int((j + 0.5) * len(rates) / len(mine)), len(rates) - 1)]
        self.used: dict[str, float] = {}              # the acceptance each tier's drafting rows were taken at
        self.draws = np.random.default_rng(0)
        self.passes = self.rows = self.accepted = 0   # passes that planned drafts; decode rows and drafts taken in all
        self.seen: set[int] = set()                   # rows the draft model has taken in
        self.drafting, self.draft_s = 0, 0.0          # passes that ran the draft model, and its seconds in all

    def take(self, sched: Scheduler, planned) -> tuple[dict[int, int], list[list[int]]]:
        """({row: drafts accepted}, [[row, drafts carried]]) of the pass `planned`, as the streamer reports them."""
        self.rows += planned.shape.decode_rows
        bounds = dict(planned.drafts)
        self.passes += bool(bounds)
        if not bounds or (self.acceptance is None and self.drafter is None):
            return {}, []
        took = {}
        for r, k in bounds.items():
            a, tier = self.of(r), tier_of(self.by_id[r].prompt)
            if a is not None:
                self.used[tier] = self.tiers.get(tier, a) if r in self.own else a
            hits = self.draws.random(k) < (a or 0.0)
            run = k if hits.all() else int(np.argmin(hits))   # accepted until the first rejection
            took[r] = min(run, max(self.by_id[r].out - sched.generated[r], 0))
        self.accepted += sum(took.values())
        return took, [[r, k] for r, k in bounds.items()]

    def of(self, row: int) -> float | None:
        """The acceptance `row`'s drafts are taken at: its own from its tier's spread, else its tier's, else the
        model's (None: not measured)."""
        return self.own.get(row, self.tiers.get(tier_of(self.by_id[row].prompt), self.acceptance))

    def priors(self, rows: list[int]) -> list[float]:
        """The scheduler's starting acceptance of each of `rows` (Scheduler's `priors`), as admission's: its tier's
        own, else drafts.PRIOR (Calibrator.starting_rates)."""
        return drafts.starting(self.tiers, [self.by_id[r].prompt for r in rows])

    def steps_s(self, sched: Scheduler, drafted: list[list[int]]) -> float:
        """What the draft model's steps add to a pass that drafted `drafted`, rows it has not seen taken in first."""
        if self.drafter is None or not drafted:
            return 0.0
        new = [r for r, _ in drafted if r not in self.seen]
        self.seen.update(new)
        tokens = sum(self.by_id[r].prompt + self.by_id[r].context + sched.generated[r] for r in new)
        seconds = self.drafter.seconds(len(drafted), max(k for _, k in drafted), tokens)
        self.drafting, self.draft_s = self.drafting + 1, self.draft_s + seconds
        return seconds


def _share(tiers, by_id, running: list[int], seconds: float) -> dict[str, int]:
    """Each tier's share of a pass: the fraction of its running rows. Returns tier -> rows."""
    counts: dict[str, int] = {}
    for row in running:
        r = by_id[row]
        name = r.tier or tier_of(r.prompt)
        counts[name] = counts.get(name, 0) + 1
    for name, n in counts.items():
        t = tiers[name]
        t.passes, t.row_passes = t.passes + 1, t.row_passes + n
        t.seconds += seconds * n / len(running)
    return counts


def _ideal(tiers: list[Tier], rows: list[SimRow], model: PassModel, bytes_streamed: int, max_batch) -> float:
    """The whole job at the roofline: as many passes as the budget needs to hold every row for its output
    (a row takes 1/batch of it, the largest batch it fits for rows like it) and no fewer than the longest
    row's, each priced at the job's mean pass, its prompts spread over them as one group; a tier's share
    is its rows' share of the steps, as its time is. The prompts' own products are left out: a few
    passes can carry every prompt, not each pass one group."""
    if not rows:
        return 0.0
    steps, held = {}, 0.0          # each tier's output tokens; passes of the whole budget the rows hold
    for t in tiers:
        mine = [r for r in rows if (r.tier or tier_of(r.prompt)) == t.name]
        steps[t.name] = sum(r.out for r in mine)
        held += steps[t.name] / max(1, max_batch(mine[0]) if max_batch else len(rows))
    out = sum(steps.values())
    passes = max(held, max(r.out for r in rows), 1)
    shape = PassShape(int(out / passes), int(sum(r.prompt for r in rows) / passes),
                      int(sum(r.out * (r.prompt + r.out / 2) for r in rows) / passes), bytes_streamed)
    total = passes * model.roofline_s(shape)
    for t in tiers:
        t.ideal_seconds = total * steps[t.name] / out
    return total
