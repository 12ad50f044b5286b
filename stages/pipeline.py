"""One stage of a micro-batched pipeline: its layers resident, every micro-batch's KV for them, and the round.

A batch's rows are split into M micro-batches; in a round each micro-batch crosses every stage once
(its prompt in the first round, one token each later). Stage i takes micro-batch j's input (token ids on
stage 0, hidden states [rows, T, hidden] from stage i-1 elsewhere), runs its layers and sends the result on,
then takes micro-batch j+1; the last stage applies the norm and head, samples and sends the tokens to stage 0,
which feeds them to the next round. With M >= N a stage always has a micro-batch to work on:

    time ->     1    2    3    4    5    6        N = 2 stages, M = 3 micro-batches (a, b, c); a', b', c':
    stage 0     a    b    c    a'   b'   c'       the next round, fed by the tokens stage 1 sent back
    stage 1          a    b    c    a'   b'

Every micro-batch rides the same weights: a stage holds its layers for the whole round. Sends and receives
run on streams of their own, so a send of micro-batch j goes out while micro-batch j+1 computes.
"""

import dataclasses
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from spill.streamer.families import adapter_for
from spill.streamer.plan import load_plan
from spill.streamer.reader import WeightReader

from .split import resident_names


class Stage:
    """Layers `layers` of the model in `folder`, resident, with what surrounds them where this stage is the
    first (the embedding) or the last (the final norm and head)."""

    def __init__(self, folder, layers: range, *, first: bool, last: bool, dtype: mx.Dtype = mx.float32):
        plan = load_plan(folder)
        self.adapter = adapter_for(plan)
        self.layers, self.first, self.last, self.dtype = layers, first, last, dtype
        names = resident_names(plan, first, last)
        mine = dataclasses.replace(plan, resident=[t for t in plan.resident if t.name in names])
        self.bytes = sum(t.nbytes for t in mine.resident) + sum(plan.layer_bytes(i) for i in layers)
        reader = WeightReader(mine, dtype=dtype, in_flight=2)   # two in flight: the layers are kept
        try:
            self.adapter.load_resident(reader.read_resident())
            reader.start_pass(list(layers))
            for i in layers:
                self.adapter.load_layer(i, reader.take(i))
        finally:
            reader.close()
        self.caches: dict[int, list] = {}   # micro-batch -> a KV cache per layer of this stage

    def open(self, mb: int, left_padding: list[int]) -> None:
        """A micro-batch's KV for this stage's layers; its prompts left-padded by `left_padding` each."""
        self.caches[mb] = [self.adapter.make_cache(i, left_padding) for i in self.layers]

    def forward(self, mb: int, x: mx.array) -> mx.array:
        """Token ids [rows, T] (first stage) or hidden states [rows, T, hidden] through this stage's layers."""
        h = self.adapter.embed(x).astype(self.dtype) if self.first else x
        caches = self.caches[mb]
        # a mask from this stage's first cache: every layer's cache has the same offsets
        masks = self.adapter.masks(h, [caches[0]] * len(self.adapter.layers))
        hs = [h]
        for i, cache in zip(self.layers, caches):
            hs = self.adapter.run_layer(i, hs, [masks[i]], [cache])
        return hs[0]

    def greedy(self, h: mx.array) -> mx.array:
        """The last stage's tokens [rows] int32: norm, head and argmax at each row's last position."""
        return mx.argmax(self.adapter.head(h[:, -1, :]).astype(mx.float32), axis=-1).astype(mx.int32)


def micro_batches(rows: int, m: int) -> list[range]:
    """Rows 0..rows-1 in min(m, rows) contiguous micro-batches whose sizes differ by one at most."""
    m = max(1, min(m, rows))
    edges = [rows * k // m for k in range(m + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


def left_padded(prompts: list[list[int]]) -> tuple[np.ndarray, list[int]]:
    """Prompts as one [rows, longest] int32 array, padded on the left, and each row's padding."""
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    out = np.zeros((len(prompts), width), dtype=np.int32)
    for j, p in enumerate(prompts):
        out[j, pads[j]:] = p
    return out, pads


@dataclass
class Timing:
    """A stage's seconds in a run: computing, waiting for its input (a send before it included), in all."""
    busy_s: float = 0.0
    wait_s: float = 0.0
    wall_s: float = 0.0
    rounds: list = field(default_factory=list)   # per round: (busy_s, wall_s)

    @property
    def idle_share(self) -> float:
        return 1.0 - self.busy_s / self.wall_s if self.wall_s else 0.0


def run(stage: Stage, group, prompts: list[list[int]], max_tokens: int, m: int) -> tuple[list[list[int]] | None, Timing]:
    """Greedy generation of `max_tokens` tokens a row through the pipeline, `m` micro-batches a round. Every
    rank calls it with the same prompts (the plan); stage 0 returns each row's tokens, the others None."""
    n, rank = group.size(), group.rank()
    # sends and receives each on a stream beside the compute stream: a send still going out never holds
    # up the next micro-batch's input
    inbound, outbound = mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)
    batches = micro_batches(len(prompts), m)
    inputs = []
    for j, rows in enumerate(batches):
        ids, pads = left_padded([prompts[r] for r in rows])
        stage.open(j, pads)
        inputs.append(mx.array(ids))
    hidden = stage.adapter.args.hidden_size
    tokens: list[list] = [[] for _ in batches]   # stage 0: each micro-batch's tokens, round by round
    timing, start = Timing(), time.perf_counter()
    for step in range(max_tokens):
        round_busy, round_start = timing.busy_s, time.perf_counter()
        for j, rows in enumerate(batches):
            t0 = time.perf_counter()
            # 1. the input: the prompt or the last round's tokens (stage 0), hidden states (the others)
            if stage.first and step > 0:
                if n > 1:
                    tok = mx.distributed.recv((len(rows),), mx.int32, n - 1, group=group, stream=inbound)
                    mx.eval(tok)
                    tokens[j].append(tok)
                x = tokens[j][-1][:, None]
            elif stage.first:
                x = inputs[j]
            else:
                width = inputs[j].shape[1] if step == 0 else 1
                x = mx.distributed.recv((len(rows), width, hidden), stage.dtype, rank - 1, group=group, stream=inbound)
                mx.eval(x)
            t1 = time.perf_counter()
            # 2. this stage's layers; the last samples
            out = stage.forward(j, x)
            if stage.last:
                out = stage.greedy(out)
            mx.eval(out)
            timing.wait_s += t1 - t0
            timing.busy_s += time.perf_counter() - t1
            # 3. on to the next stage (the tokens back to stage 0), while the next micro-batch starts
            if stage.last and n == 1:
                tokens[j].append(out)
            else:
                mx.async_eval(mx.distributed.send(out, (rank + 1) % n, group=group, stream=outbound))
        timing.rounds.append((timing.busy_s - round_busy, time.perf_counter() - round_start))
    if stage.first and n > 1:   # the last round's tokens
        for j, rows in enumerate(batches):
            tok = mx.distributed.recv((len(rows),), mx.int32, n - 1, group=group, stream=inbound)
            mx.eval(tok)
            tokens[j].append(tok)
    mx.synchronize(outbound)
    timing.wall_s = time.perf_counter() - start
    if not stage.first:
        return None, timing
    out = [None] * len(prompts)
    for j, rows in enumerate(batches):
        per_round = np.stack([np.array(t) for t in tokens[j]], axis=1)   # [rows, max_tokens]
        for k, r in enumerate(rows):
            out[r] = per_round[k].tolist()
    return out, timing
