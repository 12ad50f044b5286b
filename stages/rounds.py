"""Several decode steps in one pass of a resident pipeline: round r+1 of a micro-batch starts on stage 0 as soon as
round r's tokens for it are back, so the stages fill and drain once a pass, not once a token.

A pass of one round over N stages and M micro-batches takes M + N - 1 turns for M turns of work (each stage idle
N - 1 of them); a pass of R rounds takes R M + N - 1:

    time ->     1    2    3    4    5    6    7          N = 2, M = 2 (a, b), R = 2: a' is round 2 of a,
    stage 0     a    b    a'   b'                         fed by a's tokens from stage 1 (back at turn 3)
    stage 1          a    b    a'   b'

Only a pass of decode rows alone runs rounds (no prompt prefills), with every layer held. Every rank runs the same
rounds; a row that ends in one (EOS, max_tokens) rides the rest as padding, its KV written at its last column. The
last stage sends each micro-batch's tokens to stage 0 at once (its next input); the middle stages take every round's
tokens once, at the end.
"""

import time

import mlx.core as mx
import numpy as np

from spill.streamer import emit
from spill.streamer.core import Streamer

from . import micro


def step(part) -> None:
    """A round's one column more for each row of a micro-batch's part, never past its slot's last column."""
    live = [j for j, r in enumerate(part.rows) if r is not None]
    part.lens[live] = np.minimum(part.lens[live] + 1, part.width - 1)
    part.at = None   # the next round writes at the new columns


def run(stage, rounds: int) -> tuple[list, float]:
    """`rounds` decode steps of every decode row (`stage`: a StagedStreamer holding all its layers, no row
    prefilling): (the tokens emitted, round by round, and the compute seconds)."""
    relay, first, last = stage.relay, stage.first, stage.last
    alone = stage.size == 1
    mbs = micro.split(list(stage.pools.values()), stage.micro_batches, len(stage.layers))
    for g in mbs:   # this round's offsets (each round sets its own): what `sampled` counts
        g.next_tokens(1)
    sampled = [g.sampled()[1] for g in mbs]   # each micro-batch's rows in the order its tokens travel
    emitted: list = [[] for _ in range(rounds)]
    drawn = np.full((rounds, sum(len(rows) for rows in sampled)), -1, dtype=np.int32)   # every round's tokens
    at = np.cumsum([0, *(len(rows) for rows in sampled)]).tolist()
    compute_s = 0.0

    def back(r: int, j: int) -> None:   # stage 0: round r's tokens of micro-batch j from the last stage
        took = np.array(relay.recv((len(sampled[j]),), mx.int32, stage.size - 1, "waiting for tokens from"))
        drawn[r, at[j]:at[j + 1]] = took
        emitted[r] += emit.taken(sampled[j], [int(t) for t in took])

    for r in range(rounds):
        for j, (g, rows) in enumerate(zip(mbs, sampled)):
            if first and r and not alone:   # round r-1's tokens of this micro-batch: its input now
                back(r - 1, j)
            ids = g.next_tokens(1)
            if first:
                h = stage._embed(ids)
            else:
                h = relay.recv((*ids.shape, stage.hidden), stage.hidden_dtype, stage.rank - 1,
                               "waiting for hidden states from")
            (h,), c, _ = Streamer._stream_layers(stage, [g], [h], [stage.adapter.masks(h, g.caches)], [])
            compute_s += c
            if last:
                c0 = time.perf_counter()
                out = Streamer._sample(stage, [(g, h)])
                compute_s += time.perf_counter() - c0
                tokens = {e.row_id: e.token for e in out}
                took = np.array([tokens.get(row.row.id, -1) for row in rows], dtype=np.int32)
                drawn[r, at[j]:at[j + 1]] = took
                emitted[r] += out
                if not alone:
                    relay.send(mx.array(took), 0, wait=False)
            else:
                relay.send(h.astype(stage.hidden_dtype), stage.rank + 1, wait=False)
            for part in g.pools:
                step(part)
    if first and not alone:   # the last round's tokens
        for j in range(len(sampled)):
            back(rounds - 1, j)
    relay.flush()
    if not last:   # the middle stages take every round's tokens in turn, as stage 0 did
        every = relay.down(drawn.ravel() if first else None, drawn.size)
        if not first:
            drawn = every.reshape(rounds, -1)
            for r in range(rounds):
                for j, rows in enumerate(sampled):
                    emitted[r] += emit.taken(rows, [int(t) for t in drawn[r, at[j]:at[j + 1]]])
    return [e for each in emitted for e in each], compute_s

