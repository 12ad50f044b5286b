"""The estimate: the admission policy and the pass model run pass by pass on the job's real token
lengths, drain tail included. Pure: a fake clock, no model, no sockets.

The streamer's semantics, pass by pass: rows admitted after pass k start prefilling in pass k+1,
in groups of like length (each its own attention), an equal share of the pass's pace each (`schedule.pace`);
a row emits its first token in the pass that ends its prompt and one token a pass after that; it
leaves after its last token and its slot is refilled next pass.

Rows whose output length is unknown are priced at max_tokens (`Estimate.at_max_tokens`).
"""

from collections import deque
from dataclasses import dataclass, field, replace

from spill.streamer.shares import bucket, chunk_for

from . import schedule
from .passmodel import PassModel, PassShape


@dataclass
class SimRow:
    row: int
    prompt: int               # prompt tokens
    out: int                  # tokens it will generate (max_tokens when unknown)
    tier: str = ""
    context: int = 0          # a running row's tokens in its KV already (the live ETA): no prefill, at once


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

    def to_dict(self) -> dict:
        return {"total_seconds": round(self.total_seconds, 3), "ideal_seconds": round(self.ideal_seconds, 3),
                "passes": self.passes, "mode": self.mode, "errors": self.errors, "priced_at_max_tokens": self.at_max_tokens, "shortfall": self.shortfall,
                "tiers": [t.to_dict() for t in self.tiers]}


def tier_of(prompt: int) -> str:
    """Length tiers of the report: prompts up to 128 tokens, up to 640, longer."""
    return "short (<=128)" if prompt <= 128 else "medium (<=640)" if prompt <= 640 else "long (>640)"


def simulate(rows: list[SimRow], policy, waiting, model: PassModel, bytes_streamed: int, *,
             chunk: int = 512, max_batch=None, errors: int = 0, at_max_tokens: bool = True,
             length=schedule.prompt_length, read_once: int = 0) -> Estimate:
    """`read_once`: bytes the first pass reads besides `bytes_streamed` (resident: every layer, once).
    `policy`: offer(list) / admit() -> list / finished(rows) and a `queue`, driven through the
    schedule as the admission actor drives it; `waiting(SimRow)` makes the policy's row record and
    `length` reads its prompt length back; `max_batch(SimRow)` is the largest batch the memory
    budget fits for rows like it (for the ideal)."""
    by_id = {r.row: r for r in rows}
    tiers: dict[str, Tier] = {}
    for r in rows:
        t = tiers.setdefault(r.tier or tier_of(r.prompt), Tier(r.tier or tier_of(r.prompt)))
        t.rows, t.prompt_tokens = t.rows + 1, t.prompt_tokens + r.prompt
    # a running row asks the policy for its slot (its full length) but starts no prompt tokens
    refused = policy.offer([waiting(replace(r, prompt=0, out=r.context + r.out) if r.context else r)
                            for r in rows]) or []
    schedule.interleave(policy.queue, length)
    policy.queue = deque(sorted(policy.queue, key=lambda w: not by_id[w.row].context))   # running rows first
    errors += len(refused)
    est = Estimate(0.0, 0.0, 0, list(tiers.values()), errors=errors, at_max_tokens=at_max_tokens)
    prefilling: dict[int, int] = {}          # row -> prompt tokens still to prefill
    group: dict[int, tuple] = {}             # row -> its prefill group (rows admitted together, of like length)
    decoding: dict[int, list[int]] = {}      # row -> [context, tokens left]
    clock, done = 0.0, 0
    allowed = schedule.pace(model, bytes_streamed, 0, 0, schedule.need(policy), most=policy.priced_prefill,
                             empty=schedule.empty(policy))
    admitted = schedule.admit(policy, allowed)
    while admitted or prefilling or decoding:
        for w in admitted:
            r = by_id[w.row]
            if r.context:
                decoding[w.row] = [r.context, r.out]
            else:
                prefilling[w.row] = r.prompt
        for k, rows_ in enumerate(bucket([by_id[w.row] for w in admitted if not by_id[w.row].context],
                                         length=lambda r: r.prompt)):
            group.update((r.row, (est.passes, k)) for r in rows_)
        # 1. the pass: every decoding row's step, a share of the pace for every prefilling row
        step = chunk_for(allowed, len(prefilling), chunk)
        shape = PassShape(len(decoding), sum(min(step, n) for n in prefilling.values()),
                          sum(c for c, _ in decoding.values()), bytes_streamed + (0 if est.passes else read_once),
                          prefill_groups=len({group[r] for r in prefilling}),
                          prefill_context=sum(min(step, n) * (by_id[r].prompt - n + min(step, n))
                                              for r, n in prefilling.items()))
        seconds = model.pass_s(shape)
        clock += seconds
        est.running.append(_share(tiers, by_id, list(prefilling) + list(decoding), seconds))
        # 2. its tokens: decode rows step, prefills that end their prompt emit their first token
        finished = []
        for row, state in decoding.items():
            state[0] += 1
            state[1] -= 1
            if state[1] == 0:
                finished.append(row)
        for row in list(prefilling):
            prefilling[row] -= min(step, prefilling[row])
            if prefilling[row] == 0:
                del prefilling[row]
                r = by_id[row]
                if r.out <= 1:
                    finished.append(row)
                else:
                    decoding[row] = [r.prompt + 1, r.out - 1]
        for row in finished:
            decoding.pop(row, None)
        done += len(finished)
        est.passes += 1
        est.timeline.append((clock, done))
        est.prefill.append(shape.prefill_tokens)
        est.allowance.append(allowed)
        # 3. the policy hears the pass and admits for the next one
        policy.finished(finished)
        allowed = schedule.pace(model, bytes_streamed, len(decoding), sum(c for c, _ in decoding.values()),
                                schedule.need(policy), schedule.cached([by_id[r].prompt - n for r, n in prefilling.items()]),
                                policy.priced_prefill, schedule.empty(policy))
        left = schedule.outstanding(list(prefilling.values()), allowed, chunk)
        admitted = schedule.admit(policy, allowed - left, bool(prefilling))
        if not (admitted or prefilling or decoding) and done + len(refused) < len(rows):
            est.stalled = True
    est.total_seconds = clock
    est.ideal_seconds = _ideal(est.tiers, rows, model, bytes_streamed, max_batch)
    return est


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
