"""Which rows join the batch at which pass, under a memory budget. Pure: no sockets, no model.

The budget is a target for live allocation at the knee of the memory curve, not at its peak:

    budget     = budget_fraction (0.78) x working set
    fixed      = resident tensors + reader buffers + layers in flight + MLX's buffer cache
                 + activations of the largest chunk + the other processes' resident memory
    KV budget  = budget - fixed

KV is reserved per row at its full length (prompt + max_tokens). The decode cache holds every
running row at the width of the longest, so the running set costs

    rows x (longest full length x KV bytes per token + per-row overhead)

e.g. rows of 100+28 and 60+40 tokens at 128 KiB per token: 2 x 128 x 128 KiB = 32 MiB.
A row is admitted, in order, only while that still fits the KV budget. Backpressure is a guard on
what the streamer reports: above the guard line (80% of the working set) nothing is admitted
until live allocation falls below guard - hysteresis; above the hard line (90%) the newest rows
are preempted (never the oldest, so the batch always moves) and wait at the head of the queue.
"""

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Waiting:
    row: int
    prompt: np.ndarray        # int32 prompt ids
    max_tokens: int
    sampling: list

    @property
    def full_length(self) -> int:
        return len(self.prompt) + self.max_tokens


@dataclass
class Sheet:
    """One model's prices on this machine."""
    working_set: int
    kv_per_token: int                        # bytes of K and V for one token in every layer
    row_overhead: int = 0                    # per running row besides its KV (logits, hidden state)
    fixed: dict[str, int] = field(default_factory=dict)
    fraction: float = 0.78
    guard: float = 0.80
    hard: float = 0.90
    hysteresis: float = 0.05

    @property
    def budget(self) -> int:
        return int(self.fraction * self.working_set)

    @property
    def kv_budget(self) -> int:
        return self.budget - sum(self.fixed.values())

    def line(self, share: float) -> int:
        return int(share * self.working_set)

    def cost(self, rows: int, longest: int) -> int:
        """Bytes reserved for `rows` running rows whose longest full length is `longest` tokens."""
        return rows * (longest * self.kv_per_token + self.row_overhead)


def fmt(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


class BudgetPolicy:
    def __init__(self, sheet: Sheet, max_rows: int = 0, prefill_tokens: int = 4096):
        self.sheet = sheet
        self.max_rows = max_rows                 # 0: the budget alone decides
        self.prefill_tokens = prefill_tokens
        self.queue: deque[Waiting] = deque()
        self.running: dict[int, Waiting] = {}    # admission order: the newest last
        self.live = 0                            # live allocation in the last pass report
        self.holding = False
        self.preempting: set[int] = set()        # sent to the streamer, not yet reported dropped

    # -- rows in and out ---------------------------------------------------------------------
    def offer(self, rows: list[Waiting]) -> list[tuple[Waiting, str]]:
        """Queue rows; returns those that can never fit, each with its sentence."""
        refused = []
        for w in rows:
            if self.sheet.cost(1, w.full_length) > self.sheet.kv_budget:
                refused.append((w, self.too_big(w)))
            else:
                self.queue.append(w)
        return refused

    def too_big(self, w: Waiting) -> str:
        s = self.sheet
        return (f"the prompt is {len(w.prompt)} tokens and max_tokens {w.max_tokens}: its KV cache needs "
                f"{fmt(s.cost(1, w.full_length))} but the KV budget is {fmt(max(s.kv_budget, 0))} "
                f"({s.fraction:.0%} of the {fmt(s.working_set)} working set, less {fmt(sum(s.fixed.values()))} "
                "for weights, buffers and other processes); lower max_tokens, shorten the prompt, "
                "or raise --memory or --budget-fraction")

    def finished(self, rows: list[int]) -> None:
        for row in rows:
            self.running.pop(row, None)
            self.preempting.discard(row)

    def preempted(self, rows: list[int]) -> None:
        """Rows the streamer dropped: back to the head of the queue, in their order."""
        self.preempting.difference_update(rows)
        back = [self.running.pop(r) for r in [r for r in self.running if r in set(rows)]]   # admission order
        self.queue.extendleft(reversed(back))

    # -- each pass --------------------------------------------------------------------------------
    def observe(self, live: int) -> None:
        """Live allocation from a pass report: hold above the guard line, resume below it less hysteresis."""
        s = self.sheet
        self.live = live
        if live >= s.line(s.guard):
            self.holding = True
        elif live < s.line(s.guard - s.hysteresis):
            self.holding = False

    def reserved(self) -> int:
        return self.sheet.cost(len(self.running), max((w.full_length for w in self.running.values()), default=0))

    def admit(self) -> list[Waiting]:
        """Rows to start now: in order, while the running set's KV fits and the pass's prompt tokens allow."""
        if self.holding and self.running:
            return []
        out, tokens = [], 0
        longest = max((w.full_length for w in self.running.values()), default=0)
        while self.queue and (not self.max_rows or len(self.running) < self.max_rows):
            head = self.queue[0]
            wider = max(longest, head.full_length)
            if self.sheet.cost(len(self.running) + 1, wider) > self.sheet.kv_budget:
                break
            if out and tokens + len(head.prompt) > self.prefill_tokens:
                break
            out.append(self.queue.popleft())
            self.running[head.row] = head
            tokens, longest = tokens + len(head.prompt), wider
            if self.holding:
                break   # above the guard with nothing running: one row, so the job still moves
        return out

    def to_preempt(self) -> list[int]:
        """Above the hard line: the newest rows whose reservations bring live allocation back under
        the guard line (at least one; never the oldest); none while earlier ones are on their way."""
        s = self.sheet
        if self.preempting or self.live < s.line(s.hard) or len(self.running) < 2:
            return []
        rows, longest = list(self.running), max(w.full_length for w in self.running.values())
        out, freed, excess = [], 0, self.live - s.line(s.guard)
        while len(rows) > 1 and (not out or freed < excess):
            out.append(rows.pop())
            freed = s.cost(len(out), longest)
        self.preempting.update(out)
        return out

    def clear(self) -> None:
        self.queue.clear()
        self.running.clear()
        self.preempting.clear()
        self.live, self.holding = 0, False


# -- prices from the model's config and the plan's tensors ---------------------------------------------
_FLOAT = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def sheet_for(plan, working_set: int, itemsize: int, *, prefill_tokens: int, prefill_chunk: int = 512,
              others: int = 0, **lines) -> Sheet:
    """The price sheet of `plan` (a streamer ModelPlan) computed in `itemsize`-byte floats."""
    def compute(t) -> int:
        return t.nbytes // _FLOAT[t.dtype] * itemsize if t.dtype in _FLOAT else t.nbytes
    c = plan.config
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    inter = int(c.get("intermediate_size") or 4 * hidden)
    layer = max((sum(compute(t) for t in ts) for ts in plan.layers), default=0)
    largest = max((compute(t) for ts in plan.layers for t in ts), default=0)
    fixed = {"resident": sum(compute(t) for t in plan.resident),
             "reader": 2 * max((sum(t.nbytes for t in ts) for ts in plan.layers), default=0),
             "layers": 2 * layer,                       # the layer computing and the next, converted
             "cache": cache_allowance(layer, largest),  # MLX's buffer cache, whose limit this sets
             "activations": prefill_tokens * ((4 * hidden + 3 * inter) * itemsize + heads * prefill_chunk * 4),
             "others": others}
    return Sheet(working_set, kv_per_token=len(plan.layers) * 2 * kv_heads * head_dim * itemsize,
                 row_overhead=(int(c.get("vocab_size", 0)) + 4 * hidden) * 4, fixed=fixed, **lines)


def cache_allowance(layer: int, largest: int) -> int:
    """MLX's buffer cache limit: two layers of freed weight buffers and the largest tensor, so weight
    buffers are recycled layer after layer instead of returned to the OS and faulted in again."""
    return 2 * layer + largest


def live_allocation(p, others: int) -> int:
    """What a pass report says the group holds: the streamer's MLX memory and buffers or its RSS,
    whichever is more, plus the other processes; the cgroup's usage (page cache included) where higher."""
    engine = max(p.active_memory + p.cache_memory + p.reader_memory, p.rss)
    return max(engine + others, p.cgroup_usage or 0)
