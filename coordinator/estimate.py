"""`spill estimate MODEL INPUT`: every row tokenized for real (the tokenizer worker's core), then the
admission policy and this machine's calibrated pass model simulated pass by pass (admission/simulate.py).
Rows that cannot run (bad lines, prompts that do not fit) are counted as errors, not priced."""

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from spill import config
from spill.errors import SpillError
from spill.admission import schedule
from spill.memory import group_rss
from spill.admission.advisor import Advice, advise
from spill.admission.calibration import model_key, open_calibration
from spill.admission.drafter import open_drafter
from spill.admission.passmodel import PassModel
from spill.admission.policy import width_class
from spill.admission.prices import shortfall
from spill.admission import simulate as sim
from spill.admission.simulate import Estimate, SimRow, Tier, simulate, tier_of
from spill.streamer.plan import load_plan
from spill.streamer.shares import KV_GROUP_SIZES, kv_format, kv_setting, plan_kv_refusal
from spill.tokenizer_worker.core import TokenizerCore
from spill.typed import AUTO_DRAFTS

from .batch_input import read_batch
from .estimate_text import duration, estimate_line
from .jobrun import row_request
from .jobstore import _write_json
from .models import resolve, variants


def _group_file() -> Path:
    return config.home() / "calibration" / "group.json"


def remember_others(others: int) -> None:
    """Keep the group's processes' memory as a job measured it, for `spill estimate` run with no group."""
    try:
        _group_file().parent.mkdir(parents=True, exist_ok=True)
        _write_json(_group_file(), {"others": int(others)})
    except OSError:
        pass   # a read-only home costs the next estimate this figure, never the job


def remembered_others() -> int | None:
    """The group's processes' memory as the last job on this machine measured it; None before any."""
    try:
        return int(json.loads(_group_file().read_text())["others"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def estimate_file(model: str, input: Path, *, max_tokens: int = 256, memory: str | None = None,
                  stream: bool = False, fraction: float | None = None,
                  kv: tuple | None = None, speculate: int = AUTO_DRAFTS, draft: str | None = None
                  ) -> tuple[Estimate, dict, Advice]:
    """(the estimate, the calibration it used with the group's memory it priced, the advice) for a batch
    file as `spill run` would run it (`fraction`: --budget-fraction, None for the default; `kv`: the KV
    quantization, (bits, group size), None unquantized; `speculate`: --speculate's drafts; `draft`: --draft's model)."""
    from .first_use import calibrate, calibrate_draft, make_demo
    from .preflight import check_tokenizer
    if model == "demo":
        make_demo()
    folder = resolve(model)
    if kv and (why := plan_kv_refusal(*kv, load_plan(folder))):
        raise SpillError(why)
    if draft:
        from .submit import vocabulary_refusal
        if why := vocabulary_refusal(folder, drafts := resolve(draft), draft):
            raise SpillError(why)
        draft = str(drafts)
    requests, bad = read_batch(Path(input))
    check_tokenizer(folder)   # its sentence, before the rows are counted with it
    rows, errors = sim_rows(folder, requests, range(len(requests)), {"max_tokens": max_tokens})
    others = remembered_others()
    batch = budget_rows(folder, rows, memory, fraction, others or 0, kv)   # what the probes time
    calibrate(folder, kv, batch)
    if draft:
        calibrate_draft(Path(draft), batch)
    advice = advise_rows(folder, rows, memory=memory, stream=stream, name=model, fraction=fraction,
                         others=others or 0, kv=kv)
    est, cal = estimate_rows(folder, rows, errors=errors + len(bad), memory=memory, resident=advice.resident,
                             fraction=fraction, others=others or 0, kv=kv, speculate=speculate, draft=draft)
    if draft and est.drafts and est.passes:   # which wins: the job as run without --draft
        without, _ = estimate_rows(folder, rows, errors=errors + len(bad), memory=memory, resident=advice.resident,
                                   fraction=fraction, others=others or 0, kv=kv, speculate=speculate)
        est.drafts["without"] = round(without.total_seconds, 3)
    if kv is None and est.passes and not est.shortfall and batch < len(rows):   # KV-bound: 8-bit KV fits more rows
        eight = (8, max(g for g in KV_GROUP_SIZES[:2] if load_plan(folder).kv_heads_and_dim[1] % g == 0))
        open_calibration(folder, kv=eight, rows=budget_rows(folder, rows, memory, fraction, others or 0, eight))
        alt, _ = estimate_rows(folder, rows, errors=errors + len(bad), memory=memory, resident=advice.resident,
                               fraction=fraction, others=others or 0, kv=eight)
        if alt.passes and alt.rows_per_pass > 1.05 * est.rows_per_pass:
            est.kv_hint = (f"KV-bound (priced unquantized): --kv-bits 8 (8-bit KV, group {eight[1]}) would run "
                           f"{alt.rows_per_pass:.1f} rows a pass against {est.rows_per_pass:.1f}, {duration(alt.total_seconds)} in all")
    return est, {**cal, "group_memory": others}, advice


def advise_rows(folder: Path, rows: list[SimRow], *, memory: str | None = None, stream: bool = False,
                name: str = "", others: int = 0, fraction: float | None = None, kv: tuple | None = None,
                stages: int = 1, micro_batches: int = 0, hosts=()) -> Advice:
    """Resident or streamed for these rows (admission/advisor.py); `name`: the MODEL argument, whose
    quantized variants in models.yaml are named when it does not fit; `others`: the group's RSS; `stages`: a
    pipeline's ranks, `micro_batches` its M, `hosts` each follower's (working set, budget fraction)."""
    cal = open_calibration(folder, kv=kv)
    return advise(load_plan(folder), rows, memory, stream=stream or config.stream(), passes=cal.model,
                  variants=variants(name), others=others, fraction=fraction, kv=kv, stages=stages,
                  micro_batches=micro_batches, rounds=config.rounds(), stage_scale=cal.stage_scale(stages), hosts=hosts,
                  replicas=config.replicas())


def budget_rows(folder: Path, rows: list[SimRow], memory: str | None = None, fraction: float | None = None,
                others: int = 0, kv: tuple | None = None, stages: int = 1) -> int:
    """The most of the job's rows the streamed budget holds at once, narrowest first: the batch its decode passes
    run (a pipeline's: its tightest stage's), which the calibration's pass probe times (0: not priced here)."""
    try:
        policy, _ = schedule.budget_policy(load_plan(folder), memory, fraction, others=others, kv=kv, stages=stages)
    except Exception:   # noqa: BLE001 - the estimate says why a budget cannot be priced; the probe runs its least
        return 0
    s, held, n = policy.sheet, 0, 0
    for size in sorted(s.slot(w, w) for w in (width_class(r.prompt + r.out) for r in rows)):
        if n >= policy.max_rows or held + size > s.kv_budget:
            break
        held, n = held + size, n + 1
    return n


def sim_rows(folder: Path, requests: list, which, defaults: dict, core=None) -> tuple[list[SimRow], int]:
    """The rows `which` tokenized for real (by `core`, else the model's own TokenizerCore): (their SimRows, how
    many cannot run)."""
    core = core or TokenizerCore(folder)
    rows, errors, which = [], 0, list(which)
    for k in range(0, len(which), 1024):
        chunk = which[k:k + 1024]
        asked = [row_request(requests[i], defaults, requests[i].seed) for i in chunk]
        for i, request, (ids, _why) in zip(chunk, asked, core.tokenize_many(chunk, asked, keep=False)):
            if ids is None:
                errors += 1
            else:
                rows.append(SimRow(i, len(ids), request.max_tokens))
    return rows, errors


def estimate_rows(folder: Path, rows: list[SimRow], *, errors: int = 0, memory: str | None = None,
                  resident: bool = False, loaded: bool = False, fraction: float | None = None,
                  others: int = 0, model: PassModel | None = None, kv: tuple | None = None,
                  speculate: int = 0, draft: str | None = None, probe: bool = True, stages: int = 1,
                  micro_batches: int = 0, hosts=(), replicas: bool = False) -> tuple[Estimate, dict]:
    """Resident: the first pass reads every layer (none once `loaded`), later ones nothing (compute alone).
    `others`: the group's processes' memory, which the budget leaves out of the KV as admission does.
    `model`: a pass model to price with in place of this machine's stored calibration. `speculate`: the job's
    drafts (0 off, K, AUTO_DRAFTS), taken at the acceptance the calibration (of the KV format) measured, by tier;
    `draft`: a draft model's folder (--draft): its weights, KV and steps priced (timed here at its first use, unless
    `loaded` or not `probe`), its drafts taken at the acceptance its jobs measured with this model. `stages`: a
    pipeline's ranks, priced at its tightest stage's budget, each on its host's (`hosts`; resident: as its stages
    run, `micro_batches` M); `replicas`: the ranks each the whole model and a share of the rows."""
    plan = load_plan(folder)
    cal = open_calibration(folder, kv=kv)
    model = model or cal.model
    pair = model_key(draft) if draft else None
    drafter = open_drafter(draft, 0 if loaded else budget_rows(folder, rows, memory, fraction, others, kv),
                           probe_it=probe and not loaded) if draft else None
    policy, waiting, max_batch = schedule.policy_for(plan, memory, model, resident, fraction, others, kv,
                                                     load_plan(draft) if draft else None, stages, hosts, replicas)
    streamed = 0 if resident else plan.streamed_bytes
    if (short := shortfall(policy.sheet)) is not None:   # admission fails such a job before its first pass
        est = Estimate(0.0, 0.0, 0, [], errors=errors, shortfall=short)
    else:
        est = simulate(rows, policy, waiting, model, streamed, max_batch=max_batch, errors=errors,
                       read_once=0 if loaded else plan.streamed_bytes - streamed, speculate=speculate,
                       acceptance=cal.acceptance_of(pair), drafter=drafter, by_tier=cal.tier_acceptance(pair),
                       spread=cal.tier_rows(pair),
                       stages=stages, micro_batches=micro_batches, stage_scale=cal.stage_scale(stages, replicas),
                       replicas=replicas, hop=schedule.hop_for(plan, hosts))
        est.ideal_seconds = ideal(est, rows, model, streamed, max_batch)
        if draft and speculate:   # said even where no pass drafted: auto found its steps dearer than its tokens
            est.drafts = {"speculate": "auto" if speculate == AUTO_DRAFTS else speculate, "acceptance": None, "passes": 0,
                          "tokens_per_decode_row": 1.0, **(est.drafts or {}), "draft": Path(draft).name,
                          "step_s": drafter and round(drafter.seconds(max(round(est.rows_per_pass), 1), 1), 3)}
        if est.drafts:   # drafts tried in all, and in each tier priced at its own acceptance
            counts, own = cal.counts(pair), cal.tier_acceptance(pair)
            est.drafts["measured"] = counts["count"]
            est.drafts["measured_tiers"] = {t: counts["tiers"][t]["count"] for t in est.drafts.get("tiers", {}) if t in own}
    est.mode, est.kv = "resident" if resident else "streamed", kv_format(*(kv or (None,)))
    est.tiers.sort(key=lambda t: TIER_ORDER.index(t.name.split()[0]) if t.name.split()[0] in TIER_ORDER else 3)
    return est, {"key": cal.key, "passes": cal.seen, **model.to_dict()}


def ideal(est: Estimate, rows: list[SimRow], model: PassModel, streamed: int, max_batch) -> float:
    """The roofline bound as simulate prices it, with each row held at the larger of the batch the budget fits
    for it and the batch its tier reached in the simulation, weighted by its output tokens: priced at its tier's
    first row's batch, or below the schedule's own, the "ideal" came out above the estimate (0.58x)."""
    tiers: dict[str, list[SimRow]] = {}
    for r in rows:
        tiers.setdefault(r.tier or tier_of(r.prompt), []).append(r)
    reached = {t.name: t.row_passes / t.passes for t in est.tiers if t.passes}
    held = {name: sum(r.out / max(max_batch(r), reached.get(name, 1)) for r in mine) for name, mine in tiers.items()}
    batch = {name: sum(r.out for r in tiers[name]) / held[name] if held[name] else 1 for name in tiers}
    total = sim._ideal(est.tiers, rows, model, streamed, lambda r: batch[r.tier or tier_of(r.prompt)])
    # drafts priced: a decode row takes the simulation's tokens a pass, so the roofline needs that many fewer passes
    per_pass = est.drafts["tokens_per_decode_row"] if est.drafts and est.drafts["acceptance"] is not None else 1.0
    for t in est.tiers:
        t.ideal_seconds /= per_pass
    return total / per_pass


TIER_ORDER = ("short", "medium", "long")   # simulate's tiers come in the order of the rows


class JobEstimate:
    """A running job's estimate: the pre-run figure, and a live ETA that re-simulates the rows left
    with the calibration as the admission actor last refitted it (at most every `every` seconds, and
    no more than `share` of the coordinator's time: a job of 50,000 rows takes a second to simulate)."""

    def __init__(self, folder: Path, rows: list[SimRow], errors: int, memory: str | None = None, every: float = 15.0,
                 advice: Advice | None = None, share: float = 0.05, others: int = 0, fraction: float | None = None,
                 first: tuple[Estimate, dict] | None = None, cost: float | None = None, kv: tuple | None = None,
                 speculate: int = 0, draft: str | None = None, probe: bool = True, stages: int = 1,
                 micro_batches: int = 0, hosts=()):
        """`first`: the pre-run figure and its calibration as simulated elsewhere (the estimate's child), `cost` its
        seconds; `speculate`: the job's drafts (JobRun.speculate); `probe`: the draft model may be timed (no job runs)."""
        self.folder, self.rows, self.memory, self.every, self.share = folder, rows, memory, every, share
        self.advice, self.others, self.fraction, self.kv = advice or Advice(False, ""), others, fraction, kv
        self.speculate, self.draft, self.stages, self.micro_batches = speculate, draft, stages, micro_batches
        self.hosts = [list(h) for h in hosts]   # a pipeline's followers' memory (schedule.budget_policy)
        self.remembered = None     # the figure last written for `spill estimate`
        started = time.monotonic()
        self.first, self.calibration = first or estimate_rows(folder, rows, errors=errors, memory=memory,
                                                              fraction=fraction, resident=self.advice.resident, others=others,
                                                              kv=kv, speculate=speculate, draft=draft, probe=probe,
                                                              stages=stages, micro_batches=micro_batches,
                                                              hosts=self.hosts, replicas=self.advice.replicas)
        self.eta_s, self.at = self.first.total_seconds, time.monotonic()
        self.cost = self.at - started if cost is None else cost    # seconds the last simulation took

    def to_wire(self) -> dict:
        """What the estimate's child hands the coordinator (JSON): the rows, the pre-run figure, the advice."""
        return {"rows": [[r.row, r.prompt, r.out, r.tier, r.context, r.max_tokens] for r in self.rows], "first": asdict(self.first),
                "calibration": self.calibration, "advice": asdict(self.advice), "others": self.others,
                "memory": self.memory, "fraction": self.fraction, "cost": self.cost, "kv": self.kv,
                "speculate": self.speculate, "draft": self.draft, "stages": self.stages,
                "micro_batches": self.micro_batches, "hosts": self.hosts}

    @classmethod
    def from_wire(cls, folder: Path, d: dict) -> "JobEstimate":
        first = {**d["first"], "tiers": [Tier(**t) for t in d["first"]["tiers"]],
                 "timeline": [tuple(p) for p in d["first"]["timeline"]]}
        return cls(folder, [SimRow(*r) for r in d["rows"]], first["errors"], d["memory"], advice=Advice(**d["advice"]),
                   others=d["others"], fraction=d["fraction"], first=(Estimate(**first), d["calibration"]), cost=d["cost"],
                   kv=tuple(d["kv"]) if d.get("kv") else None, speculate=d.get("speculate", 0), draft=d.get("draft"),
                   stages=d.get("stages", 1), micro_batches=d.get("micro_batches", 0), hosts=d.get("hosts", ()))

    def eta(self, pending: set[int], generated: dict[int, int]) -> float:
        """Seconds left: the rows still pending, less the tokens the running ones have generated."""
        if not pending:
            return 0.0   # every row is written: no count-down of the last simulation is left to show
        now = time.monotonic()
        wait = max(self.every, self.cost / self.share)
        if now - self.at >= self.eta_s:   # rows left, the count-down at 0: at most half the time
            wait = min(wait, 2 * self.cost)
        if now - self.at >= wait:
            left = [SimRow(r.row, r.prompt, max(r.out - g, 1), r.tier, context=r.prompt + g if g else 0)
                    for r in self.rows if r.row in pending for g in [generated.get(r.row, 0)]]
            self.eta_s, self.at = estimate_rows(self.folder, left, memory=self.memory, resident=self.advice.resident,
                                                loaded=True, others=self.others, fraction=self.fraction,
                                                kv=self.kv, speculate=self.speculate, draft=self.draft, stages=self.stages,
                                                hosts=self.hosts, replicas=self.advice.replicas,
                                                micro_batches=self.micro_batches)[0].total_seconds, now
            self.cost = time.monotonic() - now
        return max(self.eta_s - (now - self.at), 0.0)

    def started(self, at: float) -> None:
        """The job's first pass began at `at` (monotonic): the figure counts down from there, as the estimate
        counts the job, not from the submit (a queue, the model's load, a first-use probe come before it)."""
        if self.at != float("-inf"):   # a re-simulation already asked for stays asked for
            self.at = max(self.at, at)

    def priced(self, others: int) -> None:
        """The group's memory as admission priced the job: the ETA's from now on (re-simulated at once when
        it moved), and what `spill estimate` and the next job's estimate take until a job measures again."""
        if abs(others - self.others) > 1 << 20:
            self.others, self.at = others, float("-inf")
        if others != self.remembered:
            self.remembered = others
            remember_others(others)

    @property
    def first_line(self) -> str:
        return estimate_line(self.first)

    def to_meta(self) -> dict:
        """What job.json keeps: the figures and a timeline of rows done (at most ~200 points)."""
        step = max(1, len(self.first.timeline) // 200)
        points = self.first.timeline[::step] + self.first.timeline[-1:]
        return {**self.first.to_dict(), "line": self.first_line, "advice": self.advice.line,
                "timeline": [[round(t, 3), n] for t, n in points]}


def group_others(actors_rss: dict | None) -> int:
    """The group's own memory as admission prices it: this process and its children less the streamer, plus
    the streamer's runtime (`actors_rss`: each actor's at READY); before the streamer is READY, as last measured."""
    runtime = (actors_rss or {}).get("streamer")
    return group_rss(os.getpid(), runtime=runtime) if runtime else remembered_others() or group_rss(os.getpid())


def refusal(folder: Path, args: dict, actors_rss: dict | None = None) -> str | None:
    """Why no row of a job on `folder` can run in the group's budget (prices.shortfall), or None. A submit
    refused with it makes no job; a failure here costs the check, and admission checks again at the job's start."""
    try:
        plan = load_plan(folder)
        others = group_others(actors_rss)
        policy, _ = schedule.budget_policy(plan, args.get("memory"), args.get("budget_fraction"), others)
        return shortfall(policy.sheet)
    except Exception:   # noqa: BLE001 - e.g. a plan that does not load: the streamer fails the job with its sentence
        return None


def job_estimate(folder: Path, input: Path, pending: set[int], defaults: dict, args: dict, log,
                 actors_rss: dict | None = None, others: int | None = None, widen: bool = True) -> "JobEstimate | None":
    """The advice and estimate of a submitted job's pending rows of `input` (`args`: the submit's memory,
    budget_fraction, stream and model; `defaults`: the job's settings, its speculate among them), the group's own memory as admission prices it (`others`, else
    group_others of `actors_rss`: each actor's (RSS, file pages) at READY). What the job cannot run without
    raises a SpillError naming why (a tokenizer that does not load, a model that cannot be read); its
    calibration is probed here at the model's first use, and at the job's batch where `widen` (no job runs) and the
    calibration timed none as wide; a draft model (--draft) is timed only where `widen`. A failure in pricing costs
    the estimate, never the job."""
    rows, errors = counted_rows(folder, input, pending, defaults)
    kv = kv_setting(args)
    try:
        others = group_others(actors_rss) if others is None else others
        # the probe is one process with every layer's KV: a pipeline's wider batch (its tightest stage's) would not fit
        open_calibration(folder, kv=kv, rows=budget_rows(folder, rows, args.get("memory"), args.get("budget_fraction"),
                                                         others, kv) if widen else 0)
    except SpillError:
        raise
    except Exception as err:   # noqa: BLE001 - e.g. a family the probe cannot build: the streamer says why
        log.warning("no calibration", error=str(err))
        return None
    try:
        memory, fraction, hosts = args.get("memory"), args.get("budget_fraction"), args.get("hosts") or ()
        advice = advise_rows(folder, rows, memory=memory, stream=bool(args.get("stream")), name=args.get("model", ""),
                             others=others, fraction=fraction, kv=kv, stages=args.get("stages") or 1,
                             micro_batches=args.get("micro_batches") or 0, hosts=hosts)
        return JobEstimate(folder, rows, errors, memory, advice=advice, others=others, fraction=fraction, kv=kv,
                           speculate=defaults.get("speculate") or 0, draft=defaults.get("draft"), probe=widen,
                           stages=args.get("stages") or 1, micro_batches=args.get("micro_batches") or 0, hosts=hosts)
    except Exception as err:
        log.warning("no estimate", error=str(err))
        return None


def counted_rows(folder: Path, input: Path, pending: set[int], defaults: dict) -> tuple[list[SimRow], int]:
    """sim_rows of the pending rows; a tokenizer that does not load is the sentence the tokenizer actor would fail
    the job with."""
    if not pending:
        return [], 0
    try:
        core = TokenizerCore(folder)
    except SpillError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the tokenizer's libraries raise
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SpillError(f"{folder}: the tokenizer could not load ({why})") from None
    return sim_rows(folder, read_batch(input)[0], sorted(pending), defaults, core)
