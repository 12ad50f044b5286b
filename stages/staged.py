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
from spill.streamer.core import PassPlan, PassReport
from spill.streamer.kvquant import stored_dtype
from spill.streamer.plan import load_plan

from . import figures, micro, plans, rounds as rounds_of
from .model import micro_batches as micro_batches_of
from .ranked import OnRanks
from .relay import Relay
from .replicas import Replicas
from .split import resident_names, stage_ranges


class StagedStreamer(OnRanks):
    """This rank's stage: `layers` of the model in `folder` (rank 0: its share by bytes, or `by_compute` where the
    group runs resident, over each host's budget in `capacity`, `split.stage_shares`, and it tells the others to
    load theirs). Rank 0 drives (`run`, `step`, `clear`...: each told to the others, a plan before its pass); the
    others `follow` (`serve`)."""

    def __init__(self, folder, relay: Relay, layers: range | None = None, micro_batches: int = 0,
                 by_compute: bool = False, capacity: list[int] | None = None, **kw):
        if micro_batches < 0:
            raise SpillError(f"--micro-batches takes 0 (one a rank) or the micro-batches of a pass, 1 or more, found "
                             f"{micro_batches}")
        self.micro_batches = micro_batches_of(micro_batches, relay.size)   # a pass's micro-batches where resident
        self._micro, self._inbox, self._tokens_s = False, [], 0.0   # this pass micro-batch outer; its inputs' shapes
        self._rounds = 1   # decode steps the running plan allows (`rounds.run`)
        self.whole = plan = load_plan(folder)   # every layer's tensors: what the split is made from
        self.ranges = ranges = stage_ranges(plan, relay.size, by_compute, capacity)
        layers = ranges[relay.rank] if layers is None else layers
        rank = relay.rank
        super().__init__(folder, relay, layers=layers, holds=resident_names(plan, rank == 0, rank == relay.size - 1), **kw)
        self.hidden = self.adapter.args.hidden_size
        self.hidden_dtype = self.dtype or stored_dtype(self.plan)   # what travels between stages
        self._load(folder, kw, layers=[[r.start, r.stop] for r in ranges], micro_batches=self.micro_batches)

    def splits_as(self, by_compute: bool, capacity: list[int] | None = None) -> bool:
        """Whether the group's layers split `by_compute` (or by bytes) over `capacity` as it holds them; else it
        loads anew."""
        return stage_ranges(self.whole, self.size, by_compute, capacity) == self.ranges

    def run(self, plan: PassPlan) -> PassReport:
        plan = dataclasses.replace(plan, drafts={})   # a staged pass verifies no drafts
        self._tell("plan", plan)
        waited, self._tokens_s, self._rounds = self.relay.waited, 0.0, plan.rounds
        report = super().run(plan)
        report.link_s, report.compute_s = self.relay.waited - waited, report.compute_s - self._tokens_s
        # rank 0: the followers' figures of the pass before, or of this one where it ended every row
        self.followers = self.relay.figures(figures.own_pass(self, report) if self.rank else None, self.idle)
        return report

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


def serve(relay: Relay, on_pass=None) -> "OnRanks | None":
    """Ranks 1..N-1 of a group: load each model rank 0 names (a stage, or a replica) and follow it, until rank 0
    says exit; the last one loaded."""
    engine, (op, body) = None, plans.unpack(relay.plan())
    while op != "exit":
        if op == "load":
            name = body.pop("dtype", None)   # rank 0's compute dtype: what every rank computes in
            dtype, model = getattr(mx, name) if name else None, body.pop("model")
            engine = (Replicas(model, relay, dtype=dtype, **body) if body.pop("replicas", False) else
                      StagedStreamer(model, relay, range(*body.pop("layers")[relay.rank]), dtype=dtype, **body))
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
