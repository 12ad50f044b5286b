"""The streamer actor: one pass per loop; rows arrive from admission, tokens go to the tokenizer."""

import time

import numpy as np

from spill import config
from spill import messages as m
from spill.actor import Fault, bind_context, inbox, run_actor
from spill.errors import SpillError
from spill.platform import without_torch
from spill.wire import Mailbox

without_torch()   # here, not only in run_actor: .core imports mlx-lm, whose transformers would import torch
from .core import Row, Streamer  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

ANSWER_WAIT = (0.05, 0.5)   # the most the next pass waits for admission's answer: a fifth of the last pass, within these (s)


class StreamerActor:
    """The streamer core behind the group's messages (no sockets: tests drive it directly)."""

    def __init__(self, prefill_chunk: int = 512):
        self.prefill_chunk = prefill_chunk
        self.engine: Streamer | None = None
        self.model = ""
        self.epoch, self.job = -1, ""
        self.cache_limit = 0
        self.refused: list[tuple[int, str]] = []   # rows the engine would not take, with why

    def reset(self, msg: m.Reset) -> None:
        self.epoch, self.job = msg.epoch, msg.job
        if msg.model and msg.model != self.model:
            if self.engine is not None:
                self.engine.close()
            self.engine, self.model = None, ""
            self.engine = Streamer(msg.model, prefill_chunk=self.prefill_chunk, resident=msg.resident)
            self.model = msg.model
        elif self.engine is not None:
            self.engine.clear()
            if msg.model:
                self.engine.set_resident(msg.resident)   # the job's advice: keep the layers, or stream

    def admit(self, msg: m.Admit) -> None:
        if self.engine is None:
            return
        if msg.pools:
            self.engine.reserve(msg.pools)
        if msg.cache_limit and msg.cache_limit != self.cache_limit:
            self.engine.set_cache_limit(msg.cache_limit)
            self.cache_limit = msg.cache_limit
        eos = frozenset(msg.eos)
        widths = msg.widths or [0] * len(msg.rows)
        for row, prompt, max_tokens, (temp, top_p, top_k, seed), width in zip(
                msg.rows, m.unpack_tokens(msg.tokens, msg.lengths), msg.max_tokens, msg.sampling, widths):
            sampling = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, seed=seed)
            try:
                self.engine.add(Row(row, prompt, max_tokens, sampling, eos, width=width))
            except SpillError as err:   # one bad row: its error line; admission frees it next pass
                self.engine.left.append(row)
                self.refused.append((row, str(err)))

    def pace(self, msg: m.Pace) -> None:
        if self.engine is not None:
            self.engine.prefill_budget = msg.prefill_tokens

    def stop(self, msg: m.Stop) -> None:
        for row in msg.rows:
            self.engine.finish(row)

    def preempt(self, msg: m.Preempt) -> None:
        if self.engine is not None:
            self.engine.preempt(msg.rows, msg.pools)

    @property
    def busy(self) -> bool:
        return self.engine is not None and not (self.engine.idle and not self.engine.left)

    def step(self) -> tuple[m.Tokens, m.Pass]:
        report = self.engine.step()
        # a preempted row's text starts again: the tokenizer sees it in order with its tokens
        rows = [e.row_id for e in report.emitted] + report.preempted
        finish = [e.finish or "" for e in report.emitted] + ["preempted"] * len(report.preempted)
        tokens = np.array([e.token for e in report.emitted] + [-1] * len(report.preempted), np.int32)
        out = m.Tokens(self.epoch, report.index, rows, tokens.tobytes(), finish)
        r = report
        stats = m.Pass(self.epoch, r.index, r.seconds, r.wait_s, r.compute_s, r.decode_rows, r.prefill_tokens,
                       len(r.emitted), r.left, r.active_memory, r.peak_memory, r.bytes_streamed, self.job,
                       preempted=r.preempted, cache_memory=r.cache_memory, reader_memory=r.reader_memory,
                       rss=r.rss, cgroup_usage=r.cgroup_usage, minor_faults=r.minor_faults,
                       major_faults=r.major_faults, read_bandwidth=r.bytes_streamed / max(r.seconds, 1e-9),
                       read_s=r.read_s, prefill_groups=r.prefill_groups, prefill_context=r.prefill_context,
                       pace=r.pace)
        return out, stats


class Answer:
    """The pass report admission has not answered yet (its PACE names it, after its ADMIT): the next pass waits
    for it a fifth of the last pass at most (ANSWER_WAIT), so rows admitted after pass k start in pass k+1; with
    every slot held too, as admission may grow a pool (the H200: 37 passes against 35 without that wait)."""

    def __init__(self):
        self.index, self.until = -1, 0.0

    def awaited(self, index: int, seconds: float) -> None:
        least, most = ANSWER_WAIT
        self.index, self.until = index, time.monotonic() + min(max(seconds / 5, least), most)

    def took(self, msg) -> None:
        if isinstance(msg, m.Reset) or (isinstance(msg, m.Pace) and msg.answers >= self.index >= 0):
            self.index = -1

    def left(self) -> float | None:
        """Seconds still to wait; None when nothing is awaited (or the wait is over)."""
        left = self.until - time.monotonic()
        return left if self.index >= 0 and left > 0 else None


def run_streamer_process(endpoints, args, log) -> None:
    box = Mailbox(endpoints, "streamer", sends_to=("tokenizer", "admission", "coordinator"))
    actor = StreamerActor(prefill_chunk=args.get("prefill_chunk", 512))
    fault = Fault("streamer")
    delay = config.test_pass_delay()
    def reset(msg: m.Reset) -> None:
        try:
            actor.reset(msg)
        except Exception as err:   # noqa: BLE001 - a model that cannot load fails its job, not this process
            actor.engine, actor.model = None, ""
            why = str(err) if isinstance(err, SpillError) else f"{msg.model}: the model could not load ({type(err).__name__}: {err})"
            box.send("coordinator", m.Error(msg.epoch, [m.MODEL_ROW], ["model_error"], [why], msg.job))

    handlers = {m.Reset: reset, m.Admit: actor.admit, m.Stop: actor.stop, m.Preempt: actor.preempt, m.Pace: actor.pace}
    answer = Answer()
    def ready() -> bool:
        return actor.busy and answer.left() is None
    def wait() -> float | None:   # rows to run and the wait just over: look, do not block
        left = answer.left()
        return 0.0 if left is None and actor.busy else left
    # 1. what arrived during the last pass (blocking only with nothing to run, or for admission's answer)
    for batch in inbox(box, "streamer", log, busy=ready, wait=wait):
        for msg in batch:
            answer.took(msg)
            handlers.get(type(msg), lambda _msg: None)(msg)
        # 2. one pass, then its tokens and its report
        if ready():
            tokens, stats = actor.step()
            if actor.refused:
                rows, why = zip(*actor.refused)
                box.send("coordinator", m.Error(actor.epoch, list(rows), ["invalid_request"] * len(rows), list(why), actor.job))
                actor.refused = []
            bind_context(stats)   # later log lines carry this pass's index
            box.send("tokenizer", tokens)
            box.send("admission", stats)
            box.send("coordinator", stats)
            answer.awaited(stats.index, stats.seconds)
            fault.tick("pass")
            time.sleep(delay)
    if actor.engine is not None:
        actor.engine.close()
    box.close()


if __name__ == "__main__":
    run_actor("streamer", run_streamer_process)
