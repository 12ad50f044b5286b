"""The price sheet: what a model costs in memory on this machine, and what a pass report says is live.

The budget is a target for live allocation at the knee of the memory curve, not at its peak:

    budget     = budget_fraction (0.78; 0.90 of a CUDA GPU's own memory) x working set
    fixed      = resident tensors + reader buffers + 2 converted layers in flight (1 on a CUDA GPU) + MLX's buffer cache
                 (its limit: 1 freed layer, the stored copies a cast frees, the largest tensor, a
                 decode layer's freed KV)
                 + activations of the largest chunk + prompts' KV before they join the pool
                 + the other processes' resident memory
                 + a draft model's weights (--draft: every tensor of its safetensors, in the compute dtype)
    KV budget  = budget - fixed
    a row      = its tokens x (the target's KV a token + the draft model's, from its config) + logits and hidden state

Resident (the advisor's choice, advisor.py), "resident tensors" are every layer's and none is in flight.
On a CUDA GPU the working set is the GPU's, and what lives in the host's memory (the reader's buffers, the other
processes) is priced apart against the host's (`host`, `host_set`).
"""

from dataclasses import dataclass, field

from spill.config import BUDGET_FRACTION
from spill.memory import cache_allowance
from spill.platform import layers_in_flight, read_slots, recycles_layers
from spill.streamer.shares import kv_token_bytes, prefill_kv_tokens


@dataclass
class Sheet:
    """One model's prices on this machine."""
    working_set: int
    kv_per_token: int                        # bytes of K and V for one token in every layer, as a decode pool holds it
    prompt_kv_per_token: int = 0             # as a prefill group holds it (unquantized); 0: kv_per_token
    kv: tuple | None = None                  # the pools' KV quantization (bits, group size); None: unquantized
    draft_kv_per_token: int = 0              # the draft model's KV for one token of a row (--draft), its own cache
    row_overhead: int = 0                    # per running row besides its KV (logits, hidden state)
    layers: int = 0                          # attention's copy of one layer's KV is priced per slot (0: not)
    fixed: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)   # a CUDA GPU's: what the host holds, against host_set
    host_set: int = 0
    fraction: float = BUDGET_FRACTION
    host_fraction: float = BUDGET_FRACTION   # the host's budget share where it is apart (its page cache is there)
    source: str = "--memory"               # where the working set came from (cgroup, physical, --memory)
    cgroup_binds: bool = True                # a cgroup's limit at or under the working set (the host's, on a CUDA GPU):
                                             # its usage presses on the budget; else it is other processes' too
    guard: float = 0.80
    hard: float = 0.90
    hysteresis: float = 0.05

    @property
    def budget(self) -> int:
        return int(self.fraction * self.working_set)

    @property
    def kv_budget(self) -> int:
        return self.budget - sum(self.fixed.values())

    @property
    def cache_limit(self) -> int:
        """MLX's buffer cache limit admission sets: the freed layer's share and the KV's."""
        return self.fixed["cache"] + self.fixed.get("cache_kv", 0)

    def line(self, share: float) -> int:
        return int(share * self.working_set)

    def cost(self, rows: int, longest: int) -> int:
        """Bytes reserved for `rows` running rows whose longest full length is `longest` tokens."""
        return rows * (longest * (self.kv_per_token + self.draft_kv_per_token) + self.row_overhead)

    def prefill_kv(self, lengths: list[int]) -> int:
        """A prefill group's KV from its first chunk until it joins the pool: what Group.prefill allocates
        (prefill_kv_tokens). Groups draw on fixed["prefill_kv"] first (its margin: a layer's copy in flight)."""
        return prefill_kv_tokens(lengths) * (self.prompt_kv_per_token or self.kv_per_token)

    def slot(self, width: int, widest: int) -> int:
        """A slot of `width` tokens and its row of one layer's KV padded to the widest pool (attention's copy)."""
        return self.cost(1, width) + (widest * self.kv_per_token // self.layers if self.layers else 0)


def shortfall(sheet: Sheet) -> str | None:
    """The sentence a budget too small for the model's fixed part (no row's KV fits beside it) fails with."""
    host = sum(sheet.host.values())
    if sheet.host_set and host > sheet.host_fraction * sheet.host_set:
        return (f"the host's budget is {fmt(int(sheet.host_fraction * sheet.host_set))} ({sheet.host_fraction:.0%} of its "
                f"{fmt(sheet.host_set)}) but the reader's buffers and the other processes need {fmt(host)}; give "
                "the process more memory (raise its cgroup's limit) or use a machine with more")
    if sheet.kv_budget >= sheet.cost(1, 1):
        return None
    return (f"the budget is {fmt(sheet.budget)} ({sheet.fraction:.0%} of the {fmt(sheet.working_set)} working set, "
            f"from {sheet.source}) but the model's weights, buffers and the other processes need "
            f"{fmt(sum(sheet.fixed.values()))} before any KV cache; raise --memory or --budget-fraction, "
            "or use a machine with more memory")


def fmt(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


# -- prices from the model's config and the plan's tensors ---------------------------------------------
_FLOAT = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def sheet_for(plan, working_set: int, itemsize: int, *, prefill_tokens: int, prefill_chunk: int = 512,
              others: int = 0, resident: bool = False, host_set: int = 0, kv: tuple | None = None, draft=None,
              share: int = 1, **lines) -> Sheet:
    """The price sheet of `plan` (a streamer ModelPlan) computed in `itemsize`-byte floats. `resident`:
    every layer stays in memory after its first read (a fixed part), so no layer is in flight. `kv`: (bits,
    group size) of the decode pools' quantized KV (prompts' KV stays unquantized until it joins a pool). `draft`: the
    plan of a resident draft model (--draft), its weights fixed and its KV priced per row. `share`: replicas, each
    holding the whole model and 1/share of the rows (stages/replicas.py): a row's KV and overhead priced at 1/share.
    Each fixed price is what the streamer was measured to hold at its peak (docs/benchmarks.md, "Memory
    under the budget"); the margin is the cache's largest tensor, which the peak did not always fill."""
    def compute(t) -> int:
        return t.nbytes // _FLOAT[t.dtype] * itemsize if t.dtype in _FLOAT else t.nbytes
    c = plan.config
    hidden, heads, (kv_heads, head_dim) = int(c["hidden_size"]), int(c["num_attention_heads"]), plan.kv_heads_and_dim
    inter = int(c.get("intermediate_size") or 4 * hidden)
    kv_per_token = kv_token_bytes(len(plan.layers), kv_heads, head_dim, itemsize, *(kv or ()))
    prompt_kv = kv_token_bytes(len(plan.layers), kv_heads, head_dim, itemsize)
    layer = max((sum(compute(t) for t in ts) for ts in plan.layers), default=0)
    raw = max((sum(t.nbytes for t in ts) for ts in plan.layers), default=0)
    cast = max((sum(t.nbytes for t in ts if t.dtype in _FLOAT and _FLOAT[t.dtype] != itemsize)
                for ts in plan.layers), default=0)
    largest = max((compute(t) for ts in plan.layers for t in ts), default=0)
    kept = plan.resident + ([t for ts in plan.layers for t in ts] if resident else [])
    fixed = {"resident": sum(compute(t) for t in kept),     # embeddings, norms, head (resident: every layer)
             "reader": read_slots() * raw,              # the reader's read-ahead buffers, stored bytes (resident: pass 1)
             "layers": 0 if resident else layers_in_flight() * layer,   # converted weights alive: the layer computing
                                                                            # and the next (a CUDA GPU's: one)
             "cache": cache_allowance(layer, cast, largest, recycles_layers()),   # MLX's buffer cache at its limit
             "activations":   # hidden states, MLP intermediates and attention scores of the prefill tokens
                 prefill_tokens * ((4 * hidden + 3 * inter) * itemsize + heads * prefill_chunk * 4),
             # prompts' KV until they join the pool: twice on a CPU, once on a CUDA GPU (docs/benchmarks.md,
             # "Memory under the budget", measures both)
             "prefill_kv": (1 if host_set else 2) * prefill_tokens * prompt_kv,
             "others": others,                          # the other processes' RSS and the streamer's runtime
             "draft": 0 if draft is None else sum(compute(t) for ts in [draft.resident, *draft.layers] for t in ts)}
    host = {k: fixed.pop(k) for k in ("reader", "others")} if host_set else {}   # a CUDA GPU: the host's apart
    def per(n: int) -> int:
        return -(-n // share)
    sheet = Sheet(working_set, kv_per_token=per(kv_per_token), prompt_kv_per_token=per(prompt_kv), kv=kv,
                  layers=len(plan.layers), host=host, host_set=host_set, fixed=fixed,
                  row_overhead=per((int(c.get("vocab_size", 0)) + 4 * hidden) * 4),
                  draft_kv_per_token=0 if draft is None else per(kv_token_bytes(len(draft.layers), *draft.kv_heads_and_dim,
                                                                                itemsize)), **lines)
    # room for what each decode layer frees beside the freed layer (with Streamer.step's emptied cache: ~0 faults)
    fixed["cache_kv"] = 0 if resident else min(2 * max(sheet.kv_budget, 0) // max(len(plan.layers), 1), layer)
    return sheet


def live_allocation(p, others: int, runtime: int = 0, sheet: Sheet | None = None) -> int:
    """What a pass report says the group holds: the streamer's MLX memory and buffers or its RSS less its
    runtime (`runtime`, priced in `others`), whichever is more, plus the other processes; the cgroup's
    usage (active page cache included) where higher and its limit binds (`Sheet.cgroup_binds`). With a host's
    budget apart (a CUDA GPU): MLX's memory, or the host's memory scaled so its budget line is the GPU's,
    whichever is more."""
    cgroup = (p.cgroup_usage or 0) if sheet is None or sheet.cgroup_binds else 0
    if sheet is not None and sheet.host_set:
        host = max(p.rss - runtime + others, cgroup)
        scale = sheet.working_set * sheet.fraction / (sheet.host_set * sheet.host_fraction)
        return max(p.active_memory + p.cache_memory, int(host * scale))
    engine = max(p.active_memory + p.cache_memory + p.reader_memory, p.rss - runtime)
    return max(engine + others, cgroup)
