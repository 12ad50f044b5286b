"""Which rows join the batch at which pass, under a memory budget. Pure: no sockets, no model.

The budget and its fixed prices are the price sheet's (prices.py).

KV is reserved up front, in decode pools by width class: a row's class is its full length (prompt +
max_tokens) rounded up to a multiple of 16 up to 128, past that of an eighth of the power of two at or
above it (160, 192, ..., 640, 768, ..., 1280, ..., `width_class`), and each class with rows has its own
pool in the streamer, `slots` rows of that width, all of them run through every layer in the same pass:

    pool = slots x (width x KV bytes per token + per-row overhead
                    + widest pool's width x KV bytes per token / layers);  sum of pools <= KV budget

(the last term: attention reads one layer's KV of every pool padded to the widest, a copy.)

Slots are shared out by water-filling the KV budget (at most SPILL_MAX_ROWS slots in all, a slot per
row): each next slot goes to the class with the fewest slots per token its rows will generate (their
max_tokens), so every class drains at the same rate and no tier is left as a wall. E.g. KV budget 12 MiB,
1 MiB per 256 tokens, rows 40+10, 40+10, 40+10, 600+10, 600+10: pools (3, 64) and (2, 640), 5.75 MiB, a
slot for each row. When a class with rows waiting has no pool (first made, or drained) the shares are
recomputed: pools above their new share stop refilling and shrink at once to the rows they hold (the
streamer copies them), a new pool takes what is free, and a pool shrinks to its share once its rows drain
to it. A full pool (every slot taken at the last admission, or fewer than its rows and those that just
came) with rows waiting grows into the KV that is free (the streamer copies its rows a layer
at a time, so the copy holds one layer of the old pool twice); after a preemption shrank it, only once
REGROW_PASSES passes in a row ran within the budget (twice as many after each later preemption). Rows
join their class's pool in queue order while it has a free slot, else borrow a free slot of a wider pool
whose class waits for none: a class's rows wait in order, never behind another class's.
Backpressure is a guard on what the streamer reports: above the guard line (80% of the working set)
no KV is reserved anew (no pool made or grown; rows fill only the slots the streamer holds already) until
live allocation is back within the budget (or below guard - hysteresis, if that is higher: a job whose pools
fill the budget lives just under it); above the hard line (90%) the newest
rows are preempted (never the oldest, so the batch always moves), their pools shrink to the rows left,
and they wait at the head of the queue.
"""

from collections import Counter, deque
from dataclasses import dataclass
from itertools import islice

import numpy as np

from spill.messages import RowSampling

from . import allowance
from .prices import Sheet, fmt

REGROW_PASSES = 20   # passes in a row within the budget before a preempted pool may grow (doubled per preemption)


@dataclass
class Waiting:
    row: int
    prompt: np.ndarray        # int32 prompt ids
    max_tokens: int
    sampling: RowSampling = RowSampling()
    width: int = 0            # the width of the pool it runs in, once admitted
    pool: int = 0             # that pool's class: its own, or a wider one it borrowed a free slot of
    again: bool = False       # sent back to the queue (preempted): it keeps the head, ahead of rows queued after it
    cached: int = 0           # tokens already in its KV (the live estimate's running rows): it decodes at once

    @property
    def full_length(self) -> int:
        return len(self.prompt) + self.max_tokens


def width_class(full_length: int) -> int:
    """A row's width class, its pool's width: its full length rounded up to a multiple of an eighth of the power of
    two at or above it, at least 16 (16, ..., 128, 160, ..., 512, 640, ...): a slot wastes < 16 tokens or 25%."""
    step = max(16, (1 << (max(full_length, 1) - 1).bit_length()) // 8)
    return -(-max(full_length, 1) // step) * step


@dataclass
class Reserved:
    """One class's decode pool in the streamer; `cap`: the slots it may fill (its share, <= slots)."""
    slots: int
    width: int
    cap: int
    preempted: bool = False   # shrunk above the hard line: it grows again only after a calm spell
    filled: bool = False      # every slot taken by the last admission (rows that finished since free some)


class BudgetPolicy:
    def __init__(self, sheet: Sheet, max_rows: int = 256, prefill_tokens: int = 4096, price=None,
                 least: int = allowance.LEAST):
        self.sheet = sheet
        self.price = price                       # tokens -> the sheet with that prefill allowance priced (None: fixed)
        self.most, self.least = prefill_tokens, least   # the allowances `price` may choose between
        self.max_rows = max_rows                 # slots of all pools together, at most
        self.pools: dict[int, Reserved] = {}     # width class -> its decode pool in the streamer
        self.prefill_tokens = prefill_tokens     # prompt tokens the next pass may start
        self.priced_prefill = prefill_tokens     # what the sheet priced activations for: never more
        self.queue: deque[Waiting] = deque()
        self.running: dict[int, Waiting] = {}    # admission order: the newest last
        self.live = 0                            # live allocation in the last pass report
        self.holding = False
        self.preemptions = 0                     # this job's: each doubles the calm a preempted pool waits
        self.calm = 0                            # passes in a row within the budget since the last one
        self.came = False                        # rows offered since the pools were last shared out

    @property
    def window(self) -> int:
        """Rows at the head of the queue that admission looks at (the schedule interleaves them)."""
        return self.max_rows

    # -- rows in and out ---------------------------------------------------------------------
    def offer(self, rows: list[Waiting]) -> list[tuple[Waiting, str]]:
        """Queue rows; returns those that can never fit, each with its sentence. With a `price`, the pass's
        prompt allowance is chosen again from every row known (allowance.py)."""
        self._retune(rows)
        refused = []
        for w in rows:
            if self.needs(w) > self.sheet.kv_budget:
                refused.append((w, self.too_big(w)))
            else:
                self.queue.append(w)
                self.came = True
        return refused

    def _retune(self, new: list[Waiting]) -> None:
        """The prompt tokens a pass may carry, priced, for the rows known (a running row's prompt has started: 0, as
        the live estimate offers it): never a sheet the pools outgrow."""
        if self.price is None or not new:
            return
        known = [(0, w) for w in self.running.values()] + [(len(w.prompt), w) for w in (*self.queue, *new)]
        rows = [(prompt, w.max_tokens, self.sheet.slot(c := width_class(w.full_length), c)) for prompt, w in known]
        self.priced_prefill, self.sheet = allowance.choose(rows, self.price, self.most, self.least, self.max_rows,
                                                           self.reserved())
        self.prefill_tokens = min(self.prefill_tokens, self.priced_prefill)

    def needs(self, w: Waiting) -> int:
        """KV bytes a row needs running alone: its slot, and its prompt's KV while it prefills beyond what
        the sheet sets aside for prompts (both at once: the prompt joins its slot)."""
        s = self.sheet
        return s.slot(w.full_length, w.full_length) + max(s.prefill_kv([len(w.prompt)]) - s.fixed.get("prefill_kv", 0), 0)

    def too_big(self, w: Waiting) -> str:
        s = self.sheet
        return (f"the prompt is {len(w.prompt)} tokens and max_tokens {w.max_tokens}: its KV cache needs "
                f"{fmt(self.needs(w))} but the KV budget is {fmt(max(s.kv_budget, 0))} "
                f"({s.fraction:.0%} of the {fmt(s.working_set)} working set, less {fmt(sum(s.fixed.values()))} "
                "for weights, buffers and other processes); lower max_tokens, shorten the prompt, "
                "or raise --memory or --budget-fraction")

    def finished(self, rows: list[int]) -> None:
        for row in rows:
            self.running.pop(row, None)

    def preempted(self, rows: list[int]) -> int:
        """Rows the streamer dropped: back to the head of the queue, in their order; how many."""
        back = [self.running.pop(r) for r in [r for r in self.running if r in set(rows)]]   # admission order
        for w in back:
            w.again = True
        self.queue.extendleft(reversed(back))
        return len(back)

    # -- each pass --------------------------------------------------------------------------------
    def observe(self, live: int) -> None:
        """Live allocation from a pass report: hold above the guard line, resume below it less hysteresis
        or within the budget, whichever is higher (pools that fill the budget as priced sit just under it)."""
        s = self.sheet
        self.live = live
        if live >= s.line(s.guard):
            self.holding = True
        elif live <= s.line(max(s.guard - s.hysteresis, s.fraction)):
            self.holding = False
        self.calm = self.calm + 1 if live <= s.line(s.fraction) else 0
        if self.preemptions and self.calm >= REGROW_PASSES << (self.preemptions - 1):
            for p in self.pools.values():
                p.preempted = False

    def reserved(self, widest: int = 0) -> int:
        """Bytes of every pool, each slot priced with attention's copy padded to `widest` or the widest pool."""
        widest = max([widest, *(p.width for p in self.pools.values())])
        return sum(p.slots * self.sheet.slot(p.width, widest) for p in self.pools.values())

    def shapes(self) -> list[list[int]]:
        """[slots, width] of every decode pool, as the streamer reserves them."""
        return [[p.slots, p.width] for p in self.pools.values()]

    def _held(self) -> Counter:
        """Running rows per pool (by the pool's class)."""
        return Counter(w.pool for w in self.running.values())

    def _shares(self, rows: list[Waiting]) -> tuple[dict[int, int], dict[int, int]]:
        """(slots, width) per class of `rows`: water-filling the KV budget, each next slot to the class
        with the fewest slots per token its rows will generate, at most a slot per row."""
        s, need, count = self.sheet, Counter(), Counter()
        for w in rows:
            c = w.pool if w.row in self.running else width_class(w.full_length)   # a borrower counts where it runs
            need[c], count[c] = need[c] + max(w.max_tokens, 1), count[c] + 1
        width = {c: self.pools[c].width if c in self.pools else c for c in need}
        widest = max(width.values(), default=0)
        slots, left = dict.fromkeys(need, 0), s.kv_budget
        while sum(slots.values()) < self.max_rows:
            open_ = [c for c in need if slots[c] < count[c] and s.slot(width[c], widest) <= left]
            if not open_:
                break
            c = min(open_, key=lambda c: slots[c] / need[c])
            slots[c], left = slots[c] + 1, left - s.slot(width[c], widest)
        return slots, width

    def _resize(self) -> None:
        """Drop drained pools; when a class waits with no pool, or a full one could grow into free KV,
        share the budget again (the module docstring says how pools shrink, grow and are made)."""
        s, held = self.sheet, self._held()
        self.pools = {c: p for c, p in self.pools.items() if held[c]}
        window = list(islice(self.queue, self.window))
        waiting = list(dict.fromkeys(width_class(w.full_length) for w in window))
        new = [c for c in waiting if c not in self.pools]
        free = s.kv_budget - self.reserved()
        widest = max((p.width for p in self.pools.values()), default=0)
        queued = Counter(width_class(w.full_length) for w in window) if self.came else Counter()
        full = [c for c in waiting if (p := self.pools.get(c)) and (p.filled or held[c] + queued[c] > p.slots)
                and p.slots == p.cap and not p.preempted and self._growth(p, free, widest) > p.slots]
        self.came = False
        targets, widths = self._shares(window + list(self.running.values())) if new or full else ({}, {})
        if new or full:
            for c, p in self.pools.items():
                p.cap = min(p.cap, targets.get(c, 0))
        copy = self._grow(full, targets, free, widest) if new or full else 0
        self._shrink(held, bool(new))
        self._make(new, targets, widths, window, copy)

    def _grow(self, full: list[int], targets: dict[int, int], free: int, widest: int) -> int:
        """Full pools with rows waiting grow to their share, as far as what is free allows; returns
        the bytes their copies hold twice while they are made (one layer of each old pool)."""
        copy = 0
        for c in full:
            room = self.max_rows - sum(q.slots for q in self.pools.values())
            p, slot = self.pools[c], self.sheet.slot(self.pools[c].width, widest)
            grown = max(p.slots, min(targets[c], self._growth(p, free - copy, widest), p.slots + room))
            if grown > p.slots:
                free -= (grown - p.slots) * slot
                copy += p.slots * slot // max(self.sheet.layers, 1)
            p.slots = p.cap = grown
        return copy

    def _growth(self, p: Reserved, free: int, widest: int) -> int:
        """The slots pool `p` can grow to in `free` bytes: the streamer copies it a layer at a time, so
        the copy holds one layer of the old pool twice (the whole pool, with no layer count)."""
        slot = self.sheet.slot(p.width, widest)
        if not self.sheet.layers:
            return max(free // slot, 0)
        return p.slots + max(free - p.slots * slot // self.sheet.layers, 0) // slot

    def _shrink(self, held: Counter, others_wait: bool) -> None:
        """A pool above its share shrinks to it once its rows drain to it, or at once to the rows it holds
        when another class waits for room (the streamer copies them)."""
        for c, p in self.pools.items():
            if p.cap < p.slots and (held[c] <= p.cap or others_wait):
                p.slots = max(held[c], p.cap)

    def _make(self, new: list[int], targets: dict[int, int], widths: dict[int, int], window: list[Waiting],
              copy: int = 0) -> None:
        """Pools for classes that wait with none: their share of what is free, priced at the new widest
        pool (a wider pool pads the others' copy too); a row that fits only unrounded runs alone."""
        s = self.sheet
        for c in new:
            widest = max([widths[c], *(p.width for p in self.pools.values())])
            free, room = s.kv_budget - self.reserved(widest) - copy, self.max_rows - sum(p.slots for p in self.pools.values())
            n = min(targets[c], free // s.slot(widths[c], widest), room)
            if n >= 1:
                self.pools[c] = Reserved(n, widths[c], n)
            elif not self.pools:
                first = next(w for w in window if width_class(w.full_length) == c)
                self.pools[c] = Reserved(1, first.full_length, 1)

    def admit(self, alone: bool = True) -> list[Waiting]:
        """Rows to start now, in queue order: each into its class's pool while it has a free slot and
        the row fits its width, else into a free slot of the narrowest wider pool whose class waits for
        none (a drained class's slots run other rows), while the pass's prompt tokens allow. `alone`: no
        earlier prompt is still prefilling, so one prompt longer than the allowance may start."""
        held_back = self.holding and bool(self.running)   # above the guard: rows fill only slots already reserved
        if not held_back:
            self._resize()
        window = list(islice(self.queue, self.window))
        wanted = {width_class(w.full_length) for w in window}
        held, out, picked, tokens, blocked = self._held(), [], [], 0, set()
        lenders = Counter(r.pool for r in self.running.values() if r.pool == width_class(r.full_length))
        for i, w in enumerate(window):
            own = c = width_class(w.full_length)
            if own in blocked:
                continue   # the class's later rows keep their order behind its first blocked one
            p = self.pools.get(c)
            if p is None or held[c] >= p.cap or w.full_length > p.width:
                c = self._lender(w, held, wanted, lenders)
            if c is None:
                blocked.add(own)
                continue
            if (out or not alone) and tokens + len(w.prompt) > self.prefill_tokens:
                break
            w.width, w.pool, held[c], tokens = self.pools[c].width, c, held[c] + 1, tokens + len(w.prompt)
            out.append(w)
            picked.append(i)
            if self.holding and not held_back:
                break   # above the guard with nothing running: one row, so the job still moves
        for i in reversed(picked):
            del self.queue[i]
        for c, p in self.pools.items():
            p.filled = held[c] >= p.slots
        self.running.update((w.row, w) for w in out)
        return out

    def _lender(self, w: Waiting, held: Counter, wanted: set[int], own: Counter) -> int | None:
        """The narrowest pool wider than `w` with a free slot, whose class has no row waiting and still
        runs rows of its own (`own`: a pool that holds only borrowers lends no more, so it drains)."""
        fits = [c for c, p in self.pools.items()
                if c not in wanted and own[c] and held[c] < p.cap and w.full_length <= p.width]
        return min(fits, key=lambda c: self.pools[c].width, default=None)

    def to_preempt(self) -> list[int]:
        """Above the hard line: the newest rows whose slots bring live allocation back under the guard
        line (at least one; never the oldest). Their pools shrink to the rows left (`shapes()`, the plan's
        pools); the next plan waits for the report of this one, so `live` has seen them go."""
        s = self.sheet
        if self.live < s.line(s.hard) or len(self.running) < 2:
            return []
        rows, left, touched = list(self.running.values()), self._held(), set()
        out, excess = [], self.live - s.line(s.guard)
        widest = max(p.width for p in self.pools.values())
        def freed() -> int:
            return sum((self.pools[c].slots - left[c]) * s.slot(self.pools[c].width, widest) for c in touched)
        while len(rows) > 1 and (not out or freed() < excess):
            c = rows[-1].pool
            out.append(rows.pop().row)
            left[c] -= 1
            touched.add(c)
        for c in touched:
            self.pools[c].slots = self.pools[c].cap = left[c]
            self.pools[c].preempted = True
        self.preemptions, self.calm = self.preemptions + 1, 0
        return out

    def clear(self) -> None:
        self.queue.clear()
        self.running.clear()
        self.live, self.holding, self.pools, self.preemptions, self.calm, self.came = 0, False, {}, 0, 0, False
