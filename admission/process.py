"""The admission actor: the scheduler behind the group's messages. Tokenized rows queue; each pass report is
answered by the next plan (scheduler.py), which the streamer runs exactly; the budget's lines hold and
preempt (policy.py)."""

import os

import numpy as np

from spill import config, memory
from spill import messages as m
from spill.actor import Fault, inbox, run_actor
from spill.errors import SpillError
from spill.stages.model import micro_batches as micro_batches_of
from spill.streamer.plan import load_plan
from spill.streamer.shares import kv_format
from spill.wire import Mailbox

from . import drafts, schedule
from .calibration import Calibrator
from .policy import Waiting
from .scheduler import Planned, Scheduler
from .prices import live_allocation, shortfall
from .schedule import budget_policy


def run_admission_process(endpoints, args, log) -> None:
    box = Mailbox(endpoints, "admission", sends_to=("streamer", "coordinator", "tokenizer"))
    fault = Fault("admission")
    calibrator = Calibrator(log)
    sched, others, runtime, own = None, 0, 0, 0   # runtime: the streamer's RSS at READY, in others; own: its working set
    epoch, job, eos, stages, replicas, hosts = -1, "", [], 1, False, []
    running: Planned | None = None        # the plan the streamer runs now: one at a time, its report awaited
    for batch in inbox(box, "admission", log):
        ran = None   # this batch's (plan, its report, its drafting rows' prompt tokens, its ended rows' drafts)
        for msg in batch:
            if isinstance(msg, m.Reset):
                epoch, job, running, stages, replicas = msg.epoch, msg.job, None, msg.stages, msg.replicas
                hosts = [h.working_set for h in msg.hosts]   # each follower's, told at its join
                calibrator.reset(msg.model, msg.resident, (msg.kv_bits, msg.kv_group_size) if msg.kv_bits else None,
                                 msg.draft or "")
                if msg.model:
                    sched, others = _price(msg, args, box, log, calibrator)
                    runtime, own = msg.runtime, memory.working_set(args.get("memory")).bytes
                elif sched is not None:
                    sched.clear()
            elif sched is None:
                continue
            elif isinstance(msg, m.Tokenized):
                eos, priced = msg.eos, sched.policy.priced_prefill
                refused = sched.offer(_waiting(msg))
                if sched.policy.priced_prefill != priced:
                    s = sched.policy.sheet
                    log.info("allowance", prefill_tokens=sched.policy.priced_prefill, was=priced, kv_budget=s.kv_budget,
                             activations=s.fixed["activations"], prefill_kv=s.fixed["prefill_kv"])
                schedule.interleave(sched.policy.queue, schedule.prompt_length)
                if refused:   # their error lines to the coordinator; the tokenizer follows no text of theirs
                    box.send("coordinator", m.Error(epoch, [w.row for w, _ in refused],
                                                    ["memory_budget_exceeded"] * len(refused), [why for _, why in refused], job))
                    box.send("tokenizer", m.Ended(epoch, [w.row for w, _ in refused]))
                fault.tick("tokenized")
            elif isinstance(msg, m.Stop):
                sched.stopped(msg.rows)
            elif isinstance(msg, m.Pass) and running is not None and msg.plan == running.index:
                prompts = sched.prompts(r for r, _ in msg.drafted)   # read before the rows that ended leave
                ended = sched.reported(msg.finished, _live(msg, others, runtime, sched.policy.sheet, own, hosts),
                                       msg.accepted, msg.drafted, msg.rounds)
                ran, running = (running, msg, prompts, ended), None
                fault.tick("pass")
        if sched is None or epoch < 0:
            continue
        # the next plan as soon as the last one is reported: the streamer waits for it
        if running is None and sched.busy:
            running = sched.plan()
            box.send("streamer", _plan(epoch, running, eos, sched.policy.sheet.cache_limit))
        if ran is not None:
            planned, reported, prompts, ended = ran
            # the refit after the plan, not on the streamer's path; a chunk with drafts as it ran: padded. A pipeline's
            # pass is no pass of one process (its stages' shares, several rounds): the stage model prices it from this
            if stages == 1:
                calibrator.observe(drafts.padded(planned.shape, reported.columns), reported, prompts, ended)
            elif replicas or sched.rounds > 1 or sched.cut > 1:   # resident ranks: passes against the stage model's price
                calibrator.observe_pipeline(planned.shape, reported, stages, sched.cut, replicas)
            told = report(epoch, reported.index, sched, others, calibrator, job)
            box.send("coordinator", told)
            p = sched.policy
            log.info("pass", index=reported.index, budget=p.sheet.budget, kv_budget=p.sheet.kv_budget, live=p.live,
                     reserved=p.reserved(), pools=p.shapes(), running=len(p.running),
                     admitted=len(running.start) if running else 0, held=told.held_rows, waiting=len(p.queue),
                     preempted=len(running.drop) if running else 0, holding=p.holding)
    box.close()


def report(epoch: int, index: int, sched: Scheduler, others: int, calibrator, job: str) -> m.Budget:
    """What the coordinator's metrics take from admission after a pass: the lines, a hold, preemptions since
    the last report."""
    policy, s = sched.policy, sched.policy.sheet
    requeued, sched.returned = sched.returned, 0
    return m.Budget(epoch, index, s.working_set, s.budget, s.line(s.guard), s.line(s.hard), others,
                    len(policy.queue) if policy.holding else 0, requeued, calibrator.probe_bandwidth(), job,
                    running_rows=sched.started())


def _price(msg: m.Reset, args: dict, box, log, calibrator=None):
    """The scheduler for the job's model, its budget priced: (scheduler, other processes' RSS)."""
    try:
        plan = load_plan(msg.model)
        draft = load_plan(msg.draft) if msg.draft else None   # --draft: its weights and KV priced beside the model's
    except SpillError:
        return None, 0   # the streamer fails the job with the loader's sentence
    others = _others_rss(runtime=(msg.runtime, msg.runtime_file))   # the other processes now, and the streamer's runtime
    kv = (msg.kv_bits, msg.kv_group_size) if msg.kv_bits else None   # the pools' KV quantization
    hosts = [h.row() for h in msg.hosts]   # each follower's own memory and the link into it, told at its join
    policy, ws = budget_policy(plan, args.get("memory"), args.get("budget_fraction"), others,
                               args.get("prefill_chunk", 512), resident=msg.resident, kv=kv, draft=draft,
                               stages=msg.stages, by_compute=msg.by_compute, hosts=hosts, replicas=msg.replicas)
    sheet = policy.sheet
    log.info("budget", mode="resident" if msg.resident else "streamed", kv=kv_format(*(kv or (None,))),
             working_set=ws.bytes, source=ws.source, budget=sheet.budget, kv_budget=sheet.kv_budget,
             kv_per_token=sheet.kv_per_token, **sheet.fixed, **{f"host_{k}": v for k, v in sheet.host.items()},
             stages=msg.stages, **({"host_set": sheet.host_set} if sheet.host_set else {}))
    if (short := shortfall(sheet)) is not None:
        box.send("coordinator", m.Error(msg.epoch, [m.MODEL_ROW], ["memory_budget_exceeded"], [short], msg.job))
        return None, others
    chunk = args.get("prefill_chunk", 512)
    if calibrator:   # a resident pipeline's passes are priced with their hops (`observe_pipeline`)
        calibrator.hop = schedule.hop_for(plan, hosts)
    model = (lambda: calibrator.cal.model if calibrator.cal else None) if calibrator else (lambda: None)
    drafter = (lambda: calibrator.drafter) if calibrator else (lambda: None)   # the draft model's steps (--draft)
    priors = calibrator.priors(policy) if calibrator else None   # a new row's acceptance: its tier's, as measured
    # a resident pipeline: rounds fill it once, prompts cut in micro-batches (replicas: neither)
    pipelined = msg.stages > 1 and msg.resident and not msg.replicas
    rounds, cut = (config.rounds(), micro_batches_of(args.get("micro_batches"), msg.stages)) if pipelined else (1, 1)
    return Scheduler(policy, calibrator.pace if calibrator else None, chunk, 0 if msg.resident else plan.streamed_bytes,
                     msg.speculate, model, drafter, priors, rounds, cut), others


def _live(msg: m.Pass, others: int, runtime: int, sheet, own: int, hosts=()) -> int:
    """The group's live allocation on the scale of the sheet's working set (a pipeline's tightest stage's): rank 0's
    at its share of its own (`own`), and each follower's process (its figures of a pass, `msg.stages`) at its share of
    its host's (`hosts`); the fullest of them, so a follower past its guard line holds admission for the group."""
    live = live_allocation(msg, others, runtime, sheet)
    scaled = [live if sheet.working_set == own or not own else live * sheet.working_set // own]
    for k, stage in enumerate(msg.stages[1:]):   # each follower's process on its own host (`hosts`: working sets)
        ws = hosts[k] if k < len(hosts) else own or sheet.working_set
        scaled.append(max(stage.weights + stage.kv, stage.rss) * sheet.working_set // max(ws, 1))
    return max(scaled)


def _others_rss(parent: int | None = None, runtime: tuple = (0, 0)) -> int:
    """Resident memory of the group's processes other than the streamer: the coordinator (our parent)
    and its children, measured when a model is priced, with the streamer's `runtime` (spill/memory.py group_rss)."""
    return memory.group_rss(os.getppid() if parent is None else parent, runtime=runtime)


def _waiting(msg: m.Tokenized) -> list[Waiting]:
    """Rows as they wait: each prompt its own packed int32 array, not a list of Python ints."""
    flat = np.frombuffer(msg.tokens, dtype=np.int32)
    ends = np.cumsum(msg.lengths)
    return [Waiting(row, flat[e - n:e].copy(), mt, sp)
            for row, n, e, mt, sp in zip(msg.rows, msg.lengths, ends, msg.max_tokens, msg.sampling.rows())]


def _plan(epoch: int, planned: Planned, eos: list[int], cache_limit: int) -> m.Plan:
    rows = [w for w, _ in planned.start]
    tokens = np.concatenate([w.prompt for w in rows]).astype(np.int32).tobytes() if rows else b""
    return m.Plan(epoch=epoch, rows=[w.row for w in rows], tokens=tokens, lengths=[len(w.prompt) for w in rows],
                  max_tokens=[w.max_tokens for w in rows], sampling=m.Sampling.of(w.sampling for w in rows), eos=eos,
                  index=planned.index, widths=[w.width for w in rows], groups=[g for _, g in planned.start],
                  chunks=[[g, n] for g, n in planned.chunks.items()], drop=planned.drop, finish=planned.finish,
                  pools=planned.pools, cache_limit=cache_limit, drafts=[[r, k] for r, k in planned.drafts.items()],
                  rounds=planned.rounds)


if __name__ == "__main__":
    run_actor("admission", run_admission_process)
