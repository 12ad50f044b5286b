"""Which layers each stage holds: N contiguous ranges, balanced by what each layer costs.

A stage's load is the cost of its layers (bytes, from the safetensors headers) plus what sits around them
(the embedding on the first stage, the final norm and head on the last), over its share of the capacity
(each rank's working set; equal where not given). The split minimizes the largest load, as exo places
layers by free memory:

    layers    [10 10 10 10 10 10]   first 15 (embedding), last 15 (norm, head), 2 stages
    ranges    [0, 3) [3, 6)         loads 45 and 45
"""

import dataclasses
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


def stage_shares(plan, n: int, capacity: list[float] | None = None) -> list[StageShare]:
    """The model's layers split over n stages by bytes (`split`), with each stage's share of them."""
    def resident(first: bool, last: bool) -> int:
        names = resident_names(plan, first, last)
        return sum(t.nbytes for t in plan.resident if t.name in names)

    costs = [plan.layer_bytes(i) for i in range(len(plan.layers))]
    if n == 1:
        return [StageShare(range(len(costs)), sum(costs), resident(True, True))]
    ranges = split(costs, n, capacity=capacity, first=resident(True, False), last=resident(False, True))
    return [StageShare(r, sum(costs[i] for i in r), resident(k == 0, k == n - 1)) for k, r in enumerate(ranges)]


def stage_plans(plan, n: int) -> list:
    """Each stage's share of `plan` as a plan of its own (its layers, the tensors around them it holds): what
    a stage's memory prices."""
    if n <= 1:
        return [plan]
    return [dataclasses.replace(plan, layers=[plan.layers[i] for i in s.layers],
                                resident=[t for t in plan.resident if t.name in resident_names(plan, k == 0, k == n - 1)])
            for k, s in enumerate(stage_shares(plan, n))]
