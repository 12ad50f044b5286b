"""The streamer actor: one pass per PLAN from admission; tokens go to the tokenizer, the report to admission."""

import contextlib
import time

import numpy as np

from spill import config
from spill import messages as m
from spill.actor import Fault, bind_context, inbox, run_actor
from spill.errors import RankLost, SpillError
from spill.platform import without_torch
from spill.memory import budget_bytes
from spill.stages import figures
from spill.stages.split import host_capacity
from spill.stages.relay import group_relay
from spill.wire import Mailbox

from .families.mlx_lm_parts import without_init

without_torch()   # here, not only in run_actor: .core imports mlx-lm, whose transformers would import torch
if __name__ == "__main__":   # the actor's own process: mlx-lm's models without its __init__'s transformers
    without_init()
from .core import PassPlan, Row, Streamer  # noqa: E402
from spill.stages.ranked import tell  # noqa: E402
from spill.stages.replicas import Replicas  # noqa: E402
from spill.stages.staged import StagedStreamer  # noqa: E402


class StreamerActor:
    """The streamer core behind the group's messages (no sockets: tests drive it directly). It decides nothing:
    each PLAN is one pass, run as admission's scheduler wrote it."""

    def __init__(self, prefill_chunk: int = 512, relay=None, micro_batches: int = 0, budget: int = 0):
        self.prefill_chunk, self.micro_batches = prefill_chunk, micro_batches   # the latter a pipeline's (--micro-batches)
        self.budget = budget   # this host's memory budget: a pipeline's layers split over each host's (`_capacity`)
        self.relay = relay   # a pipeline group's (stages/relay.py): this streamer is its stage 0, the others follow
        self.engine: Streamer | None = None
        self.model = ""
        self.epoch, self.job = -1, ""
        self.cache_limit = 0

    def reset(self, msg: m.Reset) -> None:
        self.epoch, self.job = msg.epoch, msg.job
        if msg.model and (msg.model != self.model or self._splits_anew(msg)):
            if self.engine is not None:
                self.engine.close()
            self.engine, self.model = None, ""
            self.engine, self.model = self._open(msg), msg.model
        elif self.engine is not None:
            self.engine.clear()
            if msg.model:
                self.engine.set_resident(msg.resident)   # the job's advice: keep the layers, or stream
                self.engine.set_kv(msg.kv_bits or None, msg.kv_group_size)
                self.engine.speculate = msg.speculate   # the job's rows sample as its --speculate says
                self.engine.set_draft(msg.draft or None)  # the job's draft model, loaded where it changes

    def _splits_anew(self, msg: m.Reset) -> bool:
        """Several ranks split otherwise for this job (replicas, or stages by compute or by bytes): the model loads
        anew."""
        if self.relay is None:
            return False
        if isinstance(self.engine, Replicas) != msg.replicas:
            return True
        return isinstance(self.engine, StagedStreamer) and not self.engine.splits_as(msg.by_compute, self._capacity(msg))

    def _capacity(self, msg: m.Reset) -> list[int] | None:
        """Each stage's budget, where a follower's host told one of its own (admission prices the same split)."""
        return host_capacity(self.budget, [h.row() for h in msg.hosts], self.relay.size)

    def _open(self, msg: m.Reset) -> Streamer:
        kw = dict(prefill_chunk=self.prefill_chunk, resident=msg.resident, kv_bits=msg.kv_bits or None,
                  kv_group_size=msg.kv_group_size, speculate=msg.speculate, draft=msg.draft or None)
        if self.relay is None:
            return Streamer(msg.model, **kw)
        if msg.replicas:
            return Replicas(msg.model, self.relay, **kw)
        return StagedStreamer(msg.model, self.relay, micro_batches=self.micro_batches, by_compute=msg.by_compute,
                              capacity=self._capacity(msg), **kw)

    def run(self, msg: m.Plan) -> tuple[m.Tokens, m.Pass, list]:
        """The plan's pass: (tokens for the tokenizer, the report, rows refused as (row, why))."""
        if msg.cache_limit and msg.cache_limit != self.cache_limit:
            self.engine.set_cache_limit(msg.cache_limit)
            self.cache_limit = msg.cache_limit
        eos = frozenset(msg.eos)
        start = [(Row(row, prompt, max_tokens, sampling, eos, width=width), group)
                 for row, prompt, max_tokens, sampling, width, group in zip(
                     msg.rows, m.unpack_tokens(msg.tokens, msg.lengths), msg.max_tokens, msg.sampling.rows(), msg.widths,
                     msg.groups)]
        report = self.engine.run(PassPlan(start, dict(map(tuple, msg.chunks)), msg.drop, msg.finish, msg.pools,
                                          dict(map(tuple, msg.drafts)), msg.rounds))
        refused, self.engine.refused = self.engine.refused, []
        # a preempted row's text starts again, a refused row's never does: the tokenizer sees them in order
        ended = report.preempted + [row for row, _ in refused]
        rows = [e.row_id for e in report.emitted] + ended
        finish = [e.finish or "" for e in report.emitted] + ["preempted"] * len(report.preempted) + ["refused"] * len(refused)
        tokens = np.array([e.token for e in report.emitted] + [-1] * len(ended), np.int32)
        positions = [e.position for e in report.emitted] + [0] * len(ended)
        out = m.Tokens(self.epoch, report.index, rows, tokens.tobytes(), finish, positions)
        r = report
        stats = m.Pass(self.epoch, r.index, r.seconds, r.wait_s, r.compute_s, r.decode_rows, r.prefill_tokens,
                       len(r.emitted), r.left, r.active_memory, r.peak_memory, r.bytes_streamed, self.job,
                       preempted=r.preempted, cache_memory=r.cache_memory, reader_memory=r.reader_memory,
                       rss=r.rss, cgroup_usage=r.cgroup_usage, minor_faults=r.minor_faults,
                       major_faults=r.major_faults, read_bandwidth=r.bytes_streamed / max(r.seconds, 1e-9),
                       read_s=r.read_s, prefill_groups=r.prefill_groups, prefill_context=r.prefill_context,
                       plan=msg.index, accepted=[[row, n] for row, n in r.accepted.items() if n],
                       drafted=[[row, n] for row, n in r.drafted.items()], columns=r.columns, link_s=r.link_s,
                       rounds=r.rounds, stages=self._stages(r))
        return out, stats, refused

    def _stages(self, report) -> list[m.StagePass]:
        """A pipeline's figures: rank 0's of this pass, then each follower's that came (of the pass before)."""
        if self.relay is None:
            return []
        rows = [figures.own_pass(self.engine, report), *self.engine.followers]
        return [m.StagePass(**figures.pass_of(row)) for row in rows]


def run_streamer_process(endpoints, args, log) -> None:
    box = Mailbox(endpoints, "streamer", sends_to=("tokenizer", "admission", "coordinator"))
    relay = group_relay()   # several ranks (mlx.launch, or `launch.spawn`): stage 0 of a pipeline, the others follow
    actor = StreamerActor(prefill_chunk=args.get("prefill_chunk", 512), relay=relay,
                          micro_batches=args.get("micro_batches") or 0,
                          budget=budget_bytes(args.get("memory"), args.get("budget_fraction")) if relay else 0)
    fault = Fault("streamer")
    delay = config.test_pass_delay()

    def reset(msg: m.Reset) -> None:
        try:
            actor.reset(msg)
        except RankLost:
            raise   # a pipeline's rank lost while loading: the group's end (run_actor), not the model's
        except Exception as err:   # noqa: BLE001 - a model that cannot load fails its job, not this process
            actor.engine, actor.model = None, ""
            why = str(err) if isinstance(err, SpillError) else f"{msg.model}: the model could not load ({type(err).__name__}: {err})"
            box.send("coordinator", m.Error(msg.epoch, [m.MODEL_ROW], ["model_error"], [why], msg.job))

    def run(msg: m.Plan) -> None:
        # 2. one pass as planned, then its tokens and its report
        if actor.engine is None or msg.epoch != actor.epoch:
            return   # a plan of an older epoch, or for a model that did not load
        tokens, stats, refused = actor.run(msg)
        if refused:
            rows, why = zip(*refused)
            box.send("coordinator", m.Error(actor.epoch, list(rows), ["invalid_request"] * len(rows), list(why), actor.job))
        bind_context(stats)   # later log lines carry this pass's index
        box.send("admission", stats)
        # the report before the tokens: the coordinator records the pass before the tokenizer can end its last rows
        box.send("coordinator", stats)
        box.send("tokenizer", tokens)
        fault.tick("pass")
        time.sleep(delay)

    handlers = {m.Reset: reset, m.Plan: run}
    # 1. each message in turn: a plan is a pass (admission sends the next one when it has this one's report)
    hosts = [m.Host(*h) for h in relay.hosts] if relay is not None else []   # each follower's memory, told at join
    for batch in inbox(box, "streamer", log, ready={"hosts": hosts}):
        for msg in batch:
            handlers.get(type(msg), lambda _msg: None)(msg)
    if actor.engine is not None:
        actor.engine.close()
    if relay is not None:
        with contextlib.suppress(RankLost):   # the followers are gone already: nobody to let go
            tell(relay, "exit")
    box.close()


if __name__ == "__main__":
    run_actor("streamer", run_streamer_process)
