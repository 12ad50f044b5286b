"""The stage model: how a pipeline of N ranks runs a job, and the round time the estimate prices.

Ranks. `mlx.launch` (or `spill up --ranks N` on loopback) starts one process a rank. Rank 0 runs the group
as today (coordinator, tokenizer, admission) with its streamer as stage 0: the embedding and the first layer
range. Ranks 1..N-1 each run a stage (`serve.py`): the streamer core on its layer range (`split.stage_shares`:
by bytes where the group streams, by compute where it runs resident and that split fits, as the advisor chose;
the stage times t_i below are those ranges'); the last also holds the final norm and head and samples. Built
(`staged.py`): the streamer actor finds MLX_RANK and MLX_HOSTFILE (`relay.group_relay`) and, with several
ranks, names the model and each rank's layers, then sends each plan round the ring before its pass; every
stage runs it on the same rows, hidden states go r -> r+1, the last stage's tokens back to every rank, all
over `mx.distributed` (ring over TCP, JACCL over Thunderbolt), each hop between ring neighbours. No drafts (a
pipeline group runs --speculate auto with none). Built too: `spill up --ranks N`
and `spill run --ranks N` (the followers started beside the streamer on loopback, `coordinator/ring.py`: one unit,
a new ring for each streamer), `mlx.launch ... spill up` (ranks past 0 follow rank 0's streamer), a stage a line in
`spill status`, the recovery from a lost rank (below), micro-batches (below), `spill up --hostfile` (mlx.launch
on every host of MLX's hostfile) and replicas (`replicas.py`, where every rank holds the whole model).

A pass becomes micro-batches (built, `micro.py`, `staged.py`). The plan is unchanged: one plan, one pass, one
report, rank 0 sending it round the ring first. Each stage cuts the pass's groups into micro-batches: every
prefill group is one (admission opens a new group as M, `scheduler.cut`), and the decode rows (one `Decode` over every pool) are cut into M runs of about equal
rows, in the order the joint group takes them (a run is slots of one or two pools, `micro.Part`); the cut
depends on the pools alone, so every rank makes the same. A resident stage (its first pass reading each layer
for micro-batch 0) runs micro-batch outer: j through every layer, sent on beside j+1's compute, while the next stage
starts on j; the last samples once all are through and the tokens go round as before. A streamed stage keeps
the layer-outer order (one read of its share a pass) and no cut. M is `--micro-batches` on `spill up` and
`spill run` (0: one a rank, N; 1: a stage at a time), carried to the stages with "load"; quantized KV pools
(--kv-bits) are not cut (their rows stay one micro-batch). M is not chosen by price yet (`best_micro_batches` below
needs each stage's fixed and per-row seconds, which no stage reports to admission yet). A pass of decode rows
alone on a resident pipeline runs up to SPILL_ROUNDS rounds (8) (built, `rounds.py`): micro-batch j of round r+1
starts on stage 0 once its round-r tokens are back, so the fill and drain below come once a pass, not once a round.

The pass report. Every rank's report carries its compute seconds and its seconds blocked on a neighbour
(`link_s`: receives, and sends not yet gone out at the pass's end); rank 0's reaches admission and the
coordinator in its Pass message; each follower's figures (its weights, KV and memory, its pass's seconds,
compute and link, `figures.PASS`) reach rank 0 round the ring a pass behind, for `spill status`'s line a stage and
admission's backpressure. Left: a pass model fitted per stage (the estimate takes the stages as alike).

Admission budgets per stage. Each stage has its own working set (probed on its host, sent with READY) and
budget: its layers in flight (or its share resident), its buffers, and its layers' share of every row's KV.
A row starts only where every stage can hold it (the scheduler prices slots against the tightest stage); a
stage past its guard line holds admission for the group, past its hard line its newest rows are preempted.

A lost rank. A stage that exits, or misses SPILL_STAGE_TIMEOUT within a pass (rank 0's `StageLost`), ends the
group's epoch: MLX's group is fixed at init, so the supervisor stops every rank, names the lost host to the job,
and starts the streamer anew on rank 0 alone, holding every layer (streamed, any model fits one rank); the job's
unfinished rows are recomputed from their prompts, every custom_id still written once. Built. Left: a heartbeat
a round (today a stage that stops between passes is found at the next pass), and a ring anew on the hosts left.

The bubble. t_i: stage i's seconds for one micro-batch; l_i: its hop's seconds for that micro-batch's hidden
states (`Link.seconds`; the tokens on the last hop). Sends overlap the next micro-batch, so a round is

    round  = max(M * max_i t_i,  sum_i (t_i + l_i))    the busiest stage's work, or one micro-batch's trip
    idle_i = 1 - M * t_i / round                       stage i's idle share (its bubble)

and a job of K rounds adds the fill, sum_{i < N-1} (t_i + l_i), once. Equal stages with M >= N and links
faster than t / N leave no bubble; M = N with l > 0 idles each stage l / (t + l) of the round. A micro-batch
is not free: each takes the stage's weights through memory again, t_i = w_i + r_i x rows (the pass model's
fixed and per-row terms, a stage's share), so a round's work is M x w_i + r_i x B and M is the fewest >= N
that hides the trip. The estimate prices a resident pipeline's pass so (`pass_seconds`), stages alike, each hop at the
slowest link's seconds for a micro-batch's hidden states (each link timed at join, `link.measure`, and told with its
follower's memory, `hop_price`), times what such passes of this pipeline size took over that price
(`Calibration.stage_scale`).
"""

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One hop: `latency_s` one way for a message of a few bytes, `bandwidth` in bytes/s past that."""
    latency_s: float
    bandwidth: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


def hop_price(hosts, token_bytes: int):
    """tokens -> the slowest link's seconds for a micro-batch of that many tokens' hidden states (`token_bytes`
    each). `hosts`: each follower's (working set, budget fraction, latency, bandwidth of the link into it); a host
    told no link (bandwidth 0, or an older group's pair) prices none."""
    links = [Link(float(h[2]), float(h[3])) for h in hosts if len(h) > 3 and h[3] > 0]
    return lambda tokens: max((link.seconds(tokens * token_bytes) for link in links), default=0.0)


def micro_batches(given: int | None, stages: int) -> int:
    """M, a resident pipeline's micro-batches a pass: `--micro-batches` as given, 0 (or none) one a stage."""
    return given or stages


def round_seconds(stage_s: list[float], hop_s: list[float], m: int) -> float:
    """A round of m micro-batches: stage_s[i] a micro-batch's seconds at stage i, hop_s[i] on its way out."""
    return max(m * max(stage_s), sum(stage_s) + sum(hop_s))


def idle_shares(stage_s: list[float], hop_s: list[float], m: int) -> list[float]:
    """Each stage's idle share of a round (the pipeline's bubble, stage by stage)."""
    r = round_seconds(stage_s, hop_s, m)
    return [1.0 - m * t / r for t in stage_s]


def job_seconds(stage_s: list[float], hop_s: list[float], m: int, rounds: int) -> float:
    """`rounds` rounds and the fill: the first micro-batch reaching the last stage."""
    return rounds * round_seconds(stage_s, hop_s, m) + sum(stage_s[:-1]) + sum(hop_s[:-1])


def best_micro_batches(fixed_s: list[float], per_row_s: list[float], hop_s: list[float], rows: int) -> int:
    """The M (N..rows, at most a row each) with the shortest round, each stage's micro-batch priced fixed_s[i] + per_row_s[i] x rows / M;
    the fewest where several tie."""
    n = len(fixed_s)

    def round_of(m: int) -> float:
        return round_seconds([w + r * rows / m for w, r in zip(fixed_s, per_row_s)], hop_s, m)

    return min(range(min(n, rows), rows + 1), key=lambda m: (round_of(m), m))


def replica_seconds(model, shape, replicas: int) -> float:
    """Replicas' pass of `shape` (stages/replicas.py): each runs its share of the rows on the whole model, so the
    pass is one process's pass of the largest share (a 1/N share of the rows, prompt tokens and context, rounded
    up); rank 0 waits for the last. The links are taken as free (a plan out, a token a row back)."""
    def part(n: int) -> int:
        return -(-n // replicas)
    return model.pass_s(dataclasses.replace(
        shape, decode_rows=part(shape.decode_rows), prefill_tokens=part(shape.prefill_tokens),
        context_tokens=part(shape.context_tokens), prefill_context=part(shape.prefill_context)))


def pass_seconds(model, shape, stages: int, micro_batches: int, rounds: int = 1, hop=None) -> float:
    """A resident pipeline's pass of `shape` (one round's, as admission plans it) on `stages` alike stages, priced
    from the one-process pass model: each stage computes a 1/N share of the layers; the pass's K micro-batches (M of
    the decode rows, each prefill group one) each take the stage's share of the pass's fixed cost again; `rounds`
    rounds run back to back and the fill and drain come once; each stage reads its share of what the pass reads.
    `hop` (`hop_price`): a micro-batch's seconds on the slowest link, which paces the round where it is slower than
    the micro-batch's turn (sends overlap the next turn) and adds to the fill; None: the links are free."""
    c = model.compute_s(shape)
    fixed = min(model.fixed_s + model.packed_s * shape.batched, c)
    k = max(min(micro_batches, shape.decode_rows) + shape.prefill_groups, 1)
    turn = fixed / stages + (c - fixed) / (stages * k)   # one micro-batch through one stage
    link = hop((shape.decode_rows + shape.prefill_tokens) / k) if hop is not None and stages > 1 else 0.0
    return (rounds * k * max(turn, link) + (stages - 1) * (turn + link) + model.io_s(shape) / stages
            + model.overhead_s)
