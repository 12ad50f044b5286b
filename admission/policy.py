"""Which rows join the batch at which pass, under a memory budget. Pure: no sockets, no model.

The budget is a target for live allocation at the knee of the memory curve, not at its peak:

    budget     = budget_fraction (0.78) x working set
    fixed      = resident tensors + reader buffers + 2 converted layers in flight + MLX's buffer cache
                 (its limit: 1 freed layer, the stored copies a cast frees, the largest tensor)
                 + activations of the largest chunk + prompts' KV before they join the pool
                 + the other processes' resident memory
    KV budget  = budget - fixed

Resident (the advisor's choice, advisor.py), "resident tensors" are every layer's weights and no
layer is in flight.

KV is reserved up front: when a batch starts, admission sizes the streamer's decode pool, `slots`
rows of `width` tokens (the longest full length, prompt + max_tokens, of the rows waiting first,
rounded up to 256), as many slots as the KV budget buys (at most SPILL_MAX_ROWS, default 256):

    pool = slots x (width x KV bytes per token + per-row overhead)

e.g. KV budget 100 MiB, rows of 100+28 and 60+40 tokens, 128 KiB per token: width 256, 32 MiB a
slot, 3 slots (96 MiB). Rows join in order while a slot is free and they fit its width; the pool
keeps its shape until it drains, so a longer row waits for the drain and the pool is sized again.
Backpressure is a guard on what the streamer reports: above the guard line (80% of the working
set) nothing is admitted until live allocation falls below guard - hysteresis; above the hard line
(90%) the newest rows are preempted (never the oldest, so the batch always moves), the pool shrinks
to the rows left, and they wait at the head of the queue.
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
    def __init__(self, sheet: Sheet, max_rows: int = 256, prefill_tokens: int = 4096):
        self.sheet = sheet
        self.max_rows = max_rows                 # slots at most
        self.pool: tuple[int, int] | None = None  # (slots, width) of the streamer's decode pool
        self.prefill_tokens = prefill_tokens     # prompt tokens the next pass may start
        self.priced_prefill = prefill_tokens     # what the sheet priced activations for: never more
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

    def preempted(self, rows: list[int]) -> int:
        """Rows the streamer dropped: back to the head of the queue, in their order; how many."""
        self.preempting.difference_update(rows)
        back = [self.running.pop(r) for r in [r for r in self.running if r in set(rows)]]   # admission order
        self.queue.extendleft(reversed(back))
        return len(back)

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
        return self.sheet.cost(*self.pool) if self.pool else 0

    def _size_pool(self) -> tuple[int, int]:
        """(slots, width) for a new batch, from the rows waiting first and the KV budget."""
        s = self.sheet
        width = -(-max(w.full_length for _, w in zip(range(self.max_rows), self.queue)) // 256) * 256
        slots = min(s.kv_budget // s.cost(1, width), self.max_rows)
        return (slots, width) if slots else (1, self.queue[0].full_length)   # offer() made sure it fits

    def admit(self) -> list[Waiting]:
        """Rows to start now: in order, while the running set's KV fits and the pass's prompt tokens allow."""
        if self.holding and self.running:
            return []
        if not self.running:
            self.pool = self._size_pool() if self.queue else None
        out, tokens = [], 0
        while self.queue and len(self.running) < self.pool[0] and self.queue[0].full_length <= self.pool[1]:
            head = self.queue[0]
            if out and tokens + len(head.prompt) > self.prefill_tokens:
                break
            out.append(self.queue.popleft())
            self.running[head.row] = head
            tokens += len(head.prompt)
            if self.holding:
                break   # above the guard with nothing running: one row, so the job still moves
        return out

    def to_preempt(self) -> list[int]:
        """Above the hard line: the newest rows whose slots bring live allocation back under the guard
        line (at least one; never the oldest); none while earlier ones are on their way. The pool
        shrinks to the slots left (`self.pool`, sent with the PREEMPT)."""
        s = self.sheet
        if self.preempting or self.live < s.line(s.hard) or len(self.running) < 2:
            return []
        rows, (slots, width) = list(self.running), self.pool
        out, excess = [], self.live - s.line(s.guard)
        while len(rows) > 1 and (not out or s.cost(slots - len(rows), width) < excess):
            out.append(rows.pop())
        self.pool = (len(rows), width)
        self.preempting.update(out)
        return out

    def clear(self) -> None:
        self.queue.clear()
        self.running.clear()
        self.preempting.clear()
        self.live, self.holding, self.pool = 0, False, None


# -- prices from the model's config and the plan's tensors ---------------------------------------------
_FLOAT = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def sheet_for(plan, working_set: int, itemsize: int, *, prefill_tokens: int, prefill_chunk: int = 512,
              others: int = 0, resident: bool = False, **lines) -> Sheet:
    """The price sheet of `plan` (a streamer ModelPlan) computed in `itemsize`-byte floats. `resident`:
    every layer stays in memory after its first read (a fixed part), so no layer is in flight.
    Each fixed price is what the streamer was measured to hold at its peak (docs/benchmarks.md, "Memory
    under the budget"); the margin is the cache's largest tensor, which the peak did not always fill."""
    def compute(t) -> int:
        return t.nbytes // _FLOAT[t.dtype] * itemsize if t.dtype in _FLOAT else t.nbytes
    c = plan.config
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    inter = int(c.get("intermediate_size") or 4 * hidden)
    kv_per_token = len(plan.layers) * 2 * kv_heads * head_dim * itemsize
    layer = max((sum(compute(t) for t in ts) for ts in plan.layers), default=0)
    raw = max((sum(t.nbytes for t in ts) for ts in plan.layers), default=0)
    cast = max((sum(t.nbytes for t in ts if t.dtype in _FLOAT and _FLOAT[t.dtype] != itemsize)
                for ts in plan.layers), default=0)
    largest = max((compute(t) for ts in plan.layers for t in ts), default=0)
    kept = plan.resident + ([t for ts in plan.layers for t in ts] if resident else [])
    fixed = {"resident": sum(compute(t) for t in kept),     # embeddings, norms, head (resident: every layer)
             "reader": 2 * raw,                         # the reader's two read buffers, stored bytes (resident: pass 1)
             "layers": 0 if resident else 2 * layer,    # converted weights alive: the layer computing and the next
             "cache": cache_allowance(layer, cast, largest),   # MLX's buffer cache at its limit (it fills to it)
             # hidden states, MLP intermediates and attention scores of the prefill tokens priced
             "activations": prefill_tokens * ((4 * hidden + 3 * inter) * itemsize + heads * prefill_chunk * 4),
             "prefill_kv": 2 * prefill_tokens * kv_per_token,   # prompts' KV until they join the pool
             "others": others}                          # the other processes' RSS and the streamer's runtime
    return Sheet(working_set, kv_per_token=kv_per_token,
                 row_overhead=(int(c.get("vocab_size", 0)) + 4 * hidden) * 4, fixed=fixed, **lines)


def cache_allowance(layer: int, cast: int, largest: int) -> int:
    """MLX's buffer cache limit: the freed layer whose buffers the next conversion takes, the stored-dtype
    copies a conversion casts from (`cast` bytes; none when stored as computed) and the largest tensor.
    The two layers in flight are priced apart: their buffers are not in the cache while alive."""
    return layer + cast + largest


def live_allocation(p, others: int, runtime: int = 0) -> int:
    """What a pass report says the group holds: the streamer's MLX memory and buffers or its RSS less its
    runtime (`runtime`, priced in `others`), whichever is more, plus the other processes; the cgroup's
    usage (page cache included) where higher."""
    engine = max(p.active_memory + p.cache_memory + p.reader_memory, p.rss - runtime)
    return max(engine + others, p.cgroup_usage or 0)
