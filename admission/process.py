"""The admission actor: owns the memory budget; queues tokenized rows and admits them pass by pass,
holds above the guard line and preempts above the hard line (see policy.py)."""

import os

import numpy as np

from spill import memory
from spill import messages as m
from spill.actor import Fault, inbox, run_actor
from spill.errors import SpillError
from spill.streamer.plan import load_plan
from spill.wire import Mailbox

from . import schedule
from .calibration import Calibrator
from .policy import Waiting
from .prices import live_allocation, shortfall
from .schedule import budget_policy


def run_admission_process(endpoints, args, log) -> None:
    box = Mailbox(endpoints, "admission", sends_to=("streamer", "coordinator"))
    fault = Fault("admission")
    calibrator = Calibrator(log, chunk=args.get("prefill_chunk", 512))
    policy, others, runtime = None, 0, 0   # runtime: the streamer's RSS at READY, in others
    epoch, job, eos, in_flight = -1, "", [], False   # in_flight: an ADMIT the streamer has not reported on
    paced = None                                     # the last PACE sent
    for batch in inbox(box, "admission", log):
        reported, requeued = None, 0
        for msg in batch:
            if isinstance(msg, m.Reset):
                epoch, job, in_flight, paced = msg.epoch, msg.job, False, None
                calibrator.reset(msg.model, msg.resident)
                if msg.model:
                    policy, others = _price(msg, args, box, log)
                    runtime = msg.runtime
                elif policy is not None:
                    policy.clear()
            elif policy is None:
                continue
            elif isinstance(msg, m.Tokenized):
                eos, priced = msg.eos, policy.priced_prefill
                refused = policy.offer(_waiting(msg))
                if policy.priced_prefill != priced:
                    log.info("allowance", prefill_tokens=policy.priced_prefill, was=priced, kv_budget=policy.sheet.kv_budget,
                             activations=policy.sheet.fixed["activations"], prefill_kv=policy.sheet.fixed["prefill_kv"])
                schedule.interleave(policy.queue, schedule.prompt_length)
                if refused:
                    box.send("coordinator", m.Error(epoch, [w.row for w, _ in refused],
                                                    ["memory_budget_exceeded"] * len(refused), [why for _, why in refused], job))
                fault.tick("tokenized")
            elif isinstance(msg, m.Pass):
                policy.finished(msg.finished)
                requeued += policy.preempted(msg.preempted)
                policy.observe(live_allocation(msg, others, runtime, policy.sheet))
                calibrator.passed(msg)
                in_flight, reported = False, msg
                fault.tick("pass")
        if policy is None or epoch < 0:
            continue
        preempt = policy.to_preempt()
        if preempt:
            box.send("streamer", m.Preempt(epoch, preempt, policy.shapes()))
        budget = calibrator.pace(schedule.need(policy), policy.priced_prefill, schedule.empty(policy))
        pace = m.Pace(epoch, budget, -1 if reported is None else reported.index)
        if reported is None and budget != paced:
            box.send("streamer", pace)   # before the rows: an idle streamer starts them as they come
        admitted = [] if in_flight else schedule.admit(policy, calibrator.allowance(), bool(calibrator.context.prefilling))
        if admitted:
            box.send("streamer", _admit(epoch, admitted, eos, policy.sheet.cache_limit, policy.shapes()))
            calibrator.admitted([w.row for w in admitted], [len(w.prompt) for w in admitted])
            in_flight = True
        paced = budget
        if reported is not None:
            box.send("streamer", pace)   # the report's answer, last: the streamer's next pass waits for it
            told = report(epoch, reported.index, policy, others, requeued, calibrator, job)
            box.send("coordinator", told)
            log.info("pass", index=reported.index, budget=policy.sheet.budget, kv_budget=policy.sheet.kv_budget,
                     live=policy.live, reserved=policy.reserved(), pools=policy.shapes(), running=len(policy.running),
                     admitted=len(admitted), held=told.held_rows,
                     waiting=len(policy.queue), preempted=len(preempt), holding=policy.holding)
    box.close()


def report(epoch: int, index: int, policy, others: int, requeued: int, calibrator, job: str) -> m.Budget:
    """What the coordinator's metrics take from admission after a pass: the lines, a hold, preemptions."""
    s = policy.sheet
    return m.Budget(epoch, index, s.working_set, s.budget, s.line(s.guard), s.line(s.hard), others,
                    len(policy.queue) if policy.holding else 0, requeued, calibrator.probe_bandwidth(), job)


def _price(msg: m.Reset, args: dict, box, log):
    """The budget for the job's model: (policy, other processes' RSS)."""
    try:
        plan = load_plan(msg.model)
    except SpillError:
        return None, 0   # the streamer fails the job with the loader's sentence
    others = _others_rss(runtime=(msg.runtime, msg.runtime_file))   # the other processes now, and the streamer's runtime
    policy, ws = budget_policy(plan, args.get("memory"), args.get("budget_fraction"), others,
                               args.get("prefill_chunk", 512), resident=msg.resident)
    sheet = policy.sheet
    log.info("budget", mode="resident" if msg.resident else "streamed", working_set=ws.bytes, source=ws.source, budget=sheet.budget, kv_budget=sheet.kv_budget,
             kv_per_token=sheet.kv_per_token, **sheet.fixed, **{f"host_{k}": v for k, v in sheet.host.items()},
             **({"host_set": sheet.host_set} if sheet.host_set else {}))
    if (short := shortfall(sheet)) is not None:
        box.send("coordinator", m.Error(msg.epoch, [m.MODEL_ROW], ["memory_budget_exceeded"], [short], msg.job))
        return None, others
    return policy, others


def _others_rss(parent: int | None = None, runtime: tuple = (0, 0)) -> int:
    """Resident memory of the group's processes other than the streamer: the coordinator (our parent)
    and its children, measured when a model is priced, with the streamer's `runtime` (spill/memory.py group_rss)."""
    return memory.group_rss(os.getppid() if parent is None else parent, runtime=runtime)


def _waiting(msg: m.Tokenized) -> list[Waiting]:
    """Rows as they wait: each prompt its own packed int32 array, not a list of Python ints."""
    flat = np.frombuffer(msg.tokens, dtype=np.int32)
    ends = np.cumsum(msg.lengths)
    return [Waiting(row, flat[e - n:e].copy(), mt, sp)
            for row, n, e, mt, sp in zip(msg.rows, msg.lengths, ends, msg.max_tokens, msg.sampling)]


def _admit(epoch: int, rows: list[Waiting], eos: list[int], cache_limit: int, pools: list[list[int]]) -> m.Admit:
    tokens = np.concatenate([w.prompt for w in rows]).astype(np.int32).tobytes()
    return m.Admit(epoch=epoch, rows=[w.row for w in rows], tokens=tokens, lengths=[len(w.prompt) for w in rows],
                   max_tokens=[w.max_tokens for w in rows], sampling=[w.sampling for w in rows], eos=eos,
                   cache_limit=cache_limit, widths=[w.width for w in rows], pools=pools)


if __name__ == "__main__":
    run_actor("admission", run_admission_process)
