"""The streamer core on one stage of a pipeline: its layer range, each pass as the whole group's.

Every rank holds a `StagedStreamer` and runs the same plans (rank 0 sends each to the others first), so its
rows, slots, pools and prefill groups are the same everywhere; only the math is split:

    rank 0 (first)       embed -> its layers -> hidden states [B, T, hidden] of every group to rank 1
    rank r               hidden states from r-1 -> its layers -> to r+1
    rank N-1 (last)      hidden states from N-2 -> its layers -> norm, head, a token a row -> tokens to rank 0
    every rank but N-1   the last rank's tokens, taken into its rows as sampling would have (EOS, max_tokens)

Each reads only its layers and the tensors around them it needs (`split.resident_names`), and holds KV for its
layers only. A staged pass carries no drafts: speculation (--speculate, --draft) is refused here for now.

Micro-batches (`micro_batches` M > 1, the same on every rank: rank 0's, sent with "load"). A resident stage runs
a pass micro-batch outer, layer inner (its first pass reads each layer for micro-batch 0 and keeps it): the decode
rows cut into M groups (`micro.split`), each prefill group one more (admission opens a new one as M); micro-batch
j through every layer of the stage, then sent on (beside j+1's compute) while the next stage starts on it, so a
pass takes about M + N - 1 micro-batch slots, not M x N. The last stage samples once every micro-batch is through. A streamed stage keeps the layer-outer order
(one read a pass). Every rank's report carries its seconds blocked on a neighbour (`link_s`) beside `compute_s`.
A plan of decode rows alone may allow several rounds (`PassPlan.rounds`, admission's for a resident pipeline): a
stage holding all its layers runs them back to back, so the pipeline fills and drains once for them (`rounds.py`).
"""

import dataclasses
import time

import mlx.core as mx
import numpy as np

from spill.errors import SpillError
from spill.platform import release_heap
from spill.streamer import emit
from spill.streamer.core import PassPlan, PassReport, Streamer
from spill.streamer.kvquant import stored_dtype
from spill.streamer.plan import load_plan

from . import figures, micro, plans, rounds as rounds_of
from .model import micro_batches as micro_batches_of
from .relay import Relay, StageLost
from .split import resident_names, stage_ranges


SHARED = ("prefill_chunk", "resident", "kv_bits", "kv_group_size", "seed", "micro_batches")   # every stage alike


def tell(relay: Relay, op: str, body=None) -> None:
    """Rank 0: an op (plans.py) to every other rank; elsewhere nothing (a follower does what it was told)."""
    if relay.rank == 0 and relay.size > 1:
        relay.plan(plans.pack(op, body))


class StagedStreamer(Streamer):
    """This rank's stage: `layers` of the model in `folder` (rank 0: its share by bytes, or `by_compute` where the
    group runs resident, over each host's budget in `capacity`, `split.stage_shares`, and it tells the others to
    load theirs). Rank 0 drives (`run`,
    `step`, `clear`...: each told to the others, a plan before its pass); the others `follow` (`serve`)."""

    def __init__(self, folder, relay: Relay, layers: range | None = None, micro_batches: int = 0,
                 by_compute: bool = False, capacity: list[int] | None = None, **kw):
        self.relay, self.rank, self.size = relay, relay.rank, relay.size
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        if micro_batches < 0:
            raise SpillError(f"--micro-batches takes 0 (one a rank) or the micro-batches of a pass, 1 or more, found "
                             f"{micro_batches}")
        self.micro_batches = micro_batches_of(micro_batches, self.size)   # a pass's micro-batches where resident
        self._micro, self._inbox, self._tokens_s = False, [], 0.0   # this pass micro-batch outer; its inputs' shapes
        self._rounds = 1   # decode steps the running plan allows (`rounds.run`)
        self.followers: list = []   # rank 0: each follower's figures.PASS of the pass before the last
        self.whole = plan = load_plan(folder)   # every layer's tensors: what the split is made from
        self.ranges = ranges = stage_ranges(plan, self.size, by_compute, capacity)
        layers = ranges[self.rank] if layers is None else layers
        super().__init__(folder, layers=layers, holds=resident_names(plan, self.first, self.last), **kw)
        self.hidden = self.adapter.args.hidden_size
        self.hidden_dtype = self.dtype or stored_dtype(self.plan)   # what travels between stages
        dtype = None if self.dtype is None else str(self.dtype).rsplit(".", 1)[-1]
        kw["micro_batches"] = self.micro_batches
        tell(relay, "load", {"model": str(folder), "layers": [[r.start, r.stop] for r in ranges], "dtype": dtype,
                             **{k: kw[k] for k in SHARED if k in kw}})

    def splits_as(self, by_compute: bool, capacity: list[int] | None = None) -> bool:
        """Whether the group's layers split `by_compute` (or by bytes) over `capacity` as it holds them; else it
        loads anew."""
        return stage_ranges(self.whole, self.size, by_compute, capacity) == self.ranges

    @property
    def speculate(self) -> int:
        return 0

    @speculate.setter
    def speculate(self, k: int) -> None:
        if k:
            raise SpillError("drafts are not verified across pipeline stages yet; run a group of several ranks "
                             "with --speculate 0 and no --draft")

    # -- rank 0 tells, the others follow ----------------------------------------------------------------------
    def _tell(self, op: str, body=None) -> None:
        tell(self.relay, op, body)

    def run(self, plan: PassPlan) -> PassReport:
        plan = dataclasses.replace(plan, drafts={})   # a staged pass verifies no drafts
        self._tell("plan", plan)
        waited, self._tokens_s, self._rounds = self.relay.waited, 0.0, plan.rounds
        report = super().run(plan)
        report.link_s, report.compute_s = self.relay.waited - waited, report.compute_s - self._tokens_s
        # rank 0: the followers' figures of the pass before, or of this one where it ended every row
        self.followers = self.relay.figures(figures.own_pass(self, report) if self.rank else None, self.idle)
        return report

    def follow(self, on_pass=None) -> tuple[str, object]:
        """Ranks 1..N-1: do what rank 0 says (`on_pass(report)` after each pass) until it stops this stage, names
        another model or lets the rank go: that op and its body."""
        done = {"clear": lambda _: self.clear(), "resident": self.set_resident, "kv": lambda kv: self.set_kv(*kv)}
        while True:
            op, body = plans.unpack(self.relay.plan())
            if op == "plan":
                report = self.run(body)
                if on_pass is not None:
                    on_pass(report)
            elif op in done:
                done[op](body)
            else:
                return op, body

    def clear(self) -> None:
        super().clear()
        self._tell("clear")

    def set_resident(self, resident: bool) -> None:
        super().set_resident(resident)
        self._tell("resident", resident)

    def set_kv(self, bits: int | None, group_size: int) -> None:
        super().set_kv(bits, group_size)   # rank 0 first: a format it refuses never reaches the others
        self._tell("kv", [bits, group_size])

    def set_draft(self, folder: str | None) -> None:
        if folder:
            raise SpillError("a draft model is not run across pipeline stages yet; run without --draft")

    def finish(self, row_id, reason: str = "stop") -> None:
        raise SpillError("a staged streamer changes its rows only through plans; end a row with PassPlan.finish")

    def preempt(self, row_ids, pools=None) -> None:
        raise SpillError("a staged streamer changes its rows only through plans; drop rows with PassPlan.drop")

    def close(self) -> None:
        """Rank 0 stops the others' stages (they wait for the next model, `serve`); every rank lets its reader go."""
        try:
            if self.first:   # the followers' figures of the last pass, taken before they stop: none left pending
                self.followers = self.relay.settle() or self.followers
            self._tell("stop")
        except StageLost:
            pass   # the group is gone: nobody to stop
        finally:
            super().close()

    def _pass(self, chunks: dict[int, int], bounds: dict | None = None) -> PassReport:
        """The plan's rounds where the pass has decode rows alone and every layer is held (the same on every rank);
        else one step."""
        rounds, self._rounds = self._rounds, 1
        if rounds <= 1 or chunks or self.prefills:
            return super()._pass(chunks, bounds)
        self._retire()   # the pools as the rounds find them (one step's `_pass` retires them itself)
        if not self.pools or self.kept is None or len(self.kept) < len(self.layers):
            return super()._pass(chunks, bounds)
        t0, wait0, read0 = time.perf_counter(), self._reader_s("wait_s"), self._reader_s("read_s")
        emitted, compute_s = rounds_of.run(self, rounds)
        self._retire()
        self.passes += rounds   # as many as one-step passes: a row started later draws from the same seed
        release_heap()
        report = self._report(t0, wait0, read0, compute_s, emitted, 0, 0)
        report.rounds = rounds
        return report

    # -- the pass's hand-overs: its groups, its input, its output, its tokens -----------------------------------
    def _decode(self, pools: list) -> list:
        # equal on every rank (rank 0 tells each whether it is resident): a resident stage's first pass reads each
        # layer for its first micro-batch and keeps it for the rest
        self._micro = self.micro_batches > 1 and self.kept is not None
        return micro.split(pools, self.micro_batches if self._micro else 1, len(self.layers))

    def _embed(self, tokens: mx.array) -> mx.array:
        if self.first:
            return super()._embed(tokens)
        self._inbox.append(shape := (*tokens.shape, self.hidden))   # received in `_stream_layers`, as it is needed:
        return mx.zeros(shape, self.hidden_dtype)   # a receive waiting beside the compute polls (a core's worth)

    def _stream_layers(self, groups: list, hs: list, masks: list, missing: list[int]) -> tuple[list, float, int]:
        """Layer outer (every group through each layer: a streamed stage's one read), or micro-batch outer (each
        group through every layer, sent on while the next computes); a group's input taken as it is needed."""
        inbox, self._inbox = self._inbox, []
        take = (lambda k: self.relay.recv(inbox[k], self.hidden_dtype, self.rank - 1, "waiting for hidden states from")
                ) if inbox else hs.__getitem__
        runs = [range(len(groups))] if not self._micro else [[k] for k in range(len(groups))]
        out, compute_s, streamed = [], 0.0, 0
        for ks in runs:
            done, c, s = super()._stream_layers([groups[k] for k in ks], [take(k) for k in ks], [masks[k] for k in ks],
                                                missing)
            compute_s, streamed = compute_s + c, streamed + s
            for h in done if not self.last else ():
                self.relay.send(h.astype(self.hidden_dtype), self.rank + 1, wait=False)
            out += done
        self.relay.flush()
        return out, compute_s, streamed

    def _sample(self, emitting) -> list:
        rows = emit.rows_of(emitting)
        if self.size == 1 or not rows:
            return super()._sample(emitting)
        if self.last:   # -1: a row ended from outside while its last step ran (every rank skips it alike)
            emitted = super()._sample(emitting)
            drawn = {e.row_id: e.token for e in emitted}
            self.relay.tokens(np.array([drawn.get(r.row.id, -1) for r in rows], dtype=np.int32), len(rows))
            return emitted
        waited = self.relay.waited
        tokens = self.relay.tokens(None, len(rows)).tolist()
        self._tokens_s = self.relay.waited - waited   # the core counts the sampling step as compute: this is none
        if any((t < 0) != (r.finish is not None) for r, t in zip(rows, tokens)):
            raise SpillError(f"stage {self.rank} is out of step with the last stage: their rows ended differently; "
                             "every rank must run the same plans")
        return emit.taken(rows, tokens)


def serve(relay: Relay, on_pass=None) -> "StagedStreamer | None":
    """Ranks 1..N-1 of a group: load each model rank 0 names and follow it, until rank 0 says exit; the last stage."""
    engine, (op, body) = None, plans.unpack(relay.plan())
    while op != "exit":
        if op == "load":
            name = body.pop("dtype", None)   # rank 0's compute dtype: what every stage computes in
            engine = StagedStreamer(body.pop("model"), relay, range(*body.pop("layers")[relay.rank]),
                                    dtype=getattr(mx, name) if name else None, **body)
            try:
                op, body = engine.follow(on_pass)
            finally:
                engine.close()
        elif op == "stop":   # its model is done: wait for the next
            op, body = plans.unpack(relay.plan())
        else:
            raise SpillError(f"stage {relay.rank} was told {op!r} with no model loaded; every rank must run the "
                             "same spill version")
    return engine
