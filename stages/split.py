"""Which layers each stage holds: N contiguous ranges, balanced by what a pass costs each stage.

A stage's load is the cost of its layers plus what sits around them, over its share of the capacity (each
rank's memory budget, `host_capacity`; equal where every host's is rank 0's). The split minimizes the largest
load, as exo places layers by free memory. What a layer costs depends on the group's mode (the advisor's,
`advisor.advise`):

    streamed   a pass reads the stage's share: bytes (safetensors headers), the embedding on the first
               stage and the norm and head on the last counted as they are held
    resident   a pass computes (`by_compute`): each layer's matmul weights (its parameters a token), the
               head's (vocab x hidden) on the last stage, the embedding (a gather) nothing on the first;
               by bytes where only that split's stages fit resident

    layers    [10 10 10 10 10 10]   first 15 (embedding), last 15 (norm, head), 2 stages
    streamed  [0, 3) [3, 6)         loads 45 and 45
    resident  [0, 4) [4, 6)         loads 40 and 35 (first 0, last 15)
"""

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

from spill.errors import SpillError


def split(costs: list[int], n: int, *, capacity: list[float] | None = None, first: int = 0,
          last: int = 0) -> list[range]:
    """n contiguous ranges covering every layer, a layer at least each, minimizing max(load_i / capacity_i)."""
    layers = len(costs)
    if n < 1:
        raise SpillError(f"a pipeline needs at least 1 stage, got {n}")
    if n > layers:
        raise SpillError(f"{n} stages for a model of {layers} layers: each stage needs a layer at least; "
                         f"run at most {layers} ranks")
    capacity = [1] * n if capacity is None else list(capacity)
    if len(capacity) != n or any(c <= 0 for c in capacity):
        raise SpillError(f"expected {n} positive capacities (one a stage), got {capacity}")
    cap = [Fraction(c).limit_denominator(1 << 20) for c in capacity]   # exact: equal loads tie exactly
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def load(k: int, a: int, b: int) -> Fraction:   # stage k holding layers [a, b)
        extra = (first if k == 0 else 0) + (last if k == n - 1 else 0)
        return (prefix[b] - prefix[a] + extra) / cap[k]

    # best[k][b]: the least largest load of stages 0..k holding layers [0, b); cut[k][b] where stage k starts
    best = [[None] * (layers + 1) for _ in range(n)]
    cut = [[0] * (layers + 1) for _ in range(n)]
    for b in range(1, layers - n + 2):
        best[0][b] = load(0, 0, b)
    for k in range(1, n):
        for b in range(k + 1, layers - (n - k - 1) + 1):
            for a in range(k, b):
                cand = max(best[k - 1][a], load(k, a, b))
                if best[k][b] is None or cand < best[k][b]:
                    best[k][b], cut[k][b] = cand, a
    ranges, b = [], layers
    for k in range(n - 1, 0, -1):
        a = cut[k][b]
        ranges.append(range(a, b))
        b = a
    ranges.append(range(0, b))
    return ranges[::-1]


@dataclass(frozen=True)
class StageShare:
    """A stage's layers and the bytes it holds: its layers' and what surrounds them."""
    layers: range
    layer_bytes: int
    resident_bytes: int

    @property
    def bytes(self) -> int:
        return self.layer_bytes + self.resident_bytes


def resident_names(plan, first: bool, last: bool) -> set[str]:
    """The tensors outside the layers a stage needs: the embedding on the first, the rest (norm, head; the
    embedding too where the head is tied to it) on the last."""
    tied = bool(plan.config.get("tie_word_embeddings", False)) or not any("lm_head" in t.name for t in plan.resident)
    names = set()
    for t in plan.resident:
        embedding = "embed_tokens" in t.name
        if (first and embedding) or (last and (not embedding or tied)):
            names.add(t.name)
    return names


def matmul_params(t, bits: int | None = None) -> int:
    """The weights of tensor `t` a token multiplies by: a matrix's elements (packed `bits`-bit ones counted as
    unpacked); none for a vector (a norm, a bias) or a quantized matrix's scales and biases."""
    if len(t.shape) < 2 or t.name.endswith((".scales", ".biases")):
        return 0
    n = math.prod(t.shape)
    return n * 32 // bits if bits and t.dtype == "U32" else n


def compute_costs(plan) -> tuple[list[int], int]:
    """(each layer's matmul weights, the head's): what a resident pass computes a token, layer by layer and on
    the last stage; the embedding, a gather, costs nothing."""
    bits = (plan.config.get("quantization") or {}).get("bits")
    head = resident_names(plan, False, True)   # the norm and the head (the embedding where the head is tied to it)
    return ([sum(matmul_params(t, bits) for t in ts) for ts in plan.layers],
            sum(matmul_params(t, bits) for t in plan.resident if t.name in head))


def stage_shares(plan, n: int, capacity: list[float] | None = None, *, by_compute: bool = False) -> list[StageShare]:
    """The model's layers split over n stages (`split`) by bytes (what a streamed pass reads), or `by_compute`
    (what a resident pass computes); each stage's share of the bytes."""
    def held(first: bool, last: bool) -> int:
        names = resident_names(plan, first, last)
        return sum(t.nbytes for t in plan.resident if t.name in names)

    costs = [plan.layer_bytes(i) for i in range(len(plan.layers))]
    if n == 1:
        return [StageShare(range(len(costs)), sum(costs), held(True, True))]
    if by_compute:
        work, head = compute_costs(plan)
        ranges = split(work, n, capacity=capacity, last=head)
    else:
        ranges = split(costs, n, capacity=capacity, first=held(True, False), last=held(False, True))
    return [StageShare(r, sum(costs[i] for i in r), held(k == 0, k == n - 1)) for k, r in enumerate(ranges)]


def host_capacity(own: int, hosts, n: int) -> list[int] | None:
    """Each stage's budget, rank 0's (`own`) first, where a follower's host told one of its own that differs
    (`hosts`: each follower's working set and budget fraction, rank 1 first), else None: the stages split alike."""
    budgets = [max(1, int(own))] + [max(1, int(ws * f)) for ws, f, *_ in list(hosts)[:n - 1]]
    budgets += budgets[:1] * (n - len(budgets))
    return budgets if len(set(budgets)) > 1 else None


def stage_ranges(plan, n: int, by_compute: bool = False, capacity: list[float] | None = None) -> list[range]:
    """Each stage's layers (`stage_shares`): what rank 0 sends every rank with "load", and `spill status` shows."""
    return [s.layers for s in stage_shares(plan, n, capacity, by_compute=by_compute)]


def stage_plans(plan, n: int, *, by_compute: bool = False, capacity: list[float] | None = None) -> list:
    """Each stage's share of `plan` as a plan of its own (its layers, the tensors around them it holds): what
    a stage's memory prices, for the split `stage_shares` makes."""
    if n <= 1:
        return [plan]
    return [dataclasses.replace(plan, layers=[plan.layers[i] for i in s.layers],
                                resident=[t for t in plan.resident if t.name in resident_names(plan, k == 0, k == n - 1)])
            for k, s in enumerate(stage_shares(plan, n, capacity, by_compute=by_compute))]
