"""The schedule: which waiting row goes next and how many prompt tokens a pass may start. Used by
the admission actor and by the estimate alike, so the estimate simulates the schedule that runs
(`budget_policy` builds the policy itself).

- Interleave: waiting rows are ordered so every length bucket (powers of two of the prompt) drains
  at the same rate: the j-th of m queued rows of a bucket sorts at (j + 0.5) / m. A file written
  short-first, long-last runs mixed, and no tier is left as a wall at the end.
- Pace: a pass carries every running row's decode step plus prompt tokens up to what keeps its
  compute under its weight-read time (the calibrated pass model), or what keeps the slots fed if
  more (`need`), or full speed where empty slots wait (`fill_now`); each prefilling row advances an
  equal share (`chunk_for`), and new prompts start only within what the rows still prefilling leave. Without a calibration, or resident (no read to
  hide under), the fixed SPILL_PREFILL_TOKENS.
"""

from collections import deque
from itertools import islice

import numpy as np

from spill import config, memory
from spill.platform import on_cpu
from spill.stages.model import hop_price
from spill.streamer.shares import chunk_for

from . import allowance
from .passmodel import PassShape
from .policy import BudgetPolicy, Waiting, width_class
from .prices import sheet_for


def budget_policy(plan, memory_arg=None, fraction: float | None = None, others: int = 0,
                  prefill_chunk: int = 512, resident: bool = False,
                  kv: tuple | None = None, draft=None, stages: int = 1,
                  by_compute: bool = False, hosts=(), replicas: bool = False,
                  share: int = 1) -> tuple[BudgetPolicy, memory.WorkingSet]:
    """The budget policy for `plan` on this machine (`memory_arg`: --memory, else detected, or a WorkingSet);
    `resident`: every layer's weights priced as kept in memory; `kv`: the pools' (bits, group size), or None;
    `draft`: a resident draft model's plan (--draft), its weights and KV priced; `stages`: a pipeline's ranks,
    each priced on its share against its own host's memory (`hosts`: each follower's working set and budget
    fraction, rank 1 first; a stage without one, this host's) and the policy the tightest's; `by_compute`:
    its layers split by compute, as a resident pipeline's may be (`split.stage_shares`), else by bytes; `replicas`:
    every rank the whole model and 1/stages of the rows (stages/replicas.py), each host priced so (`share`)."""
    if stages > 1:
        from spill.stages.split import host_capacity, stage_plans
        own = [(memory_arg, fraction)] + [(memory.WorkingSet(int(ws), f"rank {k}"), f)
                                          for k, (ws, f, *_) in enumerate(hosts[:stages - 1], 1)]
        own += [(memory_arg, fraction)] * (stages - len(own))
        capacity = host_capacity(memory.budget_bytes(memory_arg, fraction), hosts, stages)   # the layers split as budgets do
        plans = [plan] * stages if replicas else stage_plans(plan, stages, by_compute=by_compute, capacity=capacity)
        policies = [budget_policy(p, mem, f, others, prefill_chunk, resident, kv, draft, share=stages if replicas else 1)
                    for p, (mem, f) in zip(plans, own)]
        return min(policies, key=lambda pw: pw[0].sheet.kv_budget // max(pw[0].sheet.kv_per_token, 1))
    ws = memory_arg if isinstance(memory_arg, memory.WorkingSet) else memory.working_set(memory_arg)
    host = memory.host_apart()   # a CUDA GPU's: the host's memory, budgeted apart
    limit = memory.cgroup_limit()   # its usage counts as live only where it binds (prices.live_allocation)
    binds = limit is not None and limit <= (host or ws).bytes

    part = fraction or memory.default_fraction()

    def price(tokens: int):
        return sheet_for(plan, ws.bytes, compute_itemsize(plan), prefill_tokens=tokens, prefill_chunk=prefill_chunk,
                         others=others, resident=resident, host_set=host.bytes if host else 0, fraction=part, kv=kv,
                         draft=draft, share=share,
                         host_fraction=config.BUDGET_FRACTION, source=ws.source, cgroup_binds=binds,
                         guard=config.guard_line(bool(host), part), hard=config.hard_line(bool(host), part))
    tokens = config.prefill_tokens()
    while True:   # on a small machine, price fewer prefill tokens a pass (down to a chunk) than KV gets
        sheet = price(tokens)
        if tokens <= prefill_chunk or sheet.kv_budget >= sheet.fixed["activations"] + sheet.fixed["prefill_kv"]:
            # the most a pass may carry; the policy chooses fewer where the job's rows advance faster (allowance.py)
            return BudgetPolicy(sheet, config.max_rows(), tokens, price, min(allowance.LEAST, tokens)), ws
        tokens = max(tokens // 2, prefill_chunk)


def compute_itemsize(plan) -> int:
    """Bytes per float the streamer computes in: float32 on the CPU, the stored dtype on a GPU."""
    if on_cpu():
        return 4
    stored = [t.dtype for ts in plan.layers for t in ts if t.dtype in ("BF16", "F16", "F32")]
    return 4 if stored and stored[0] == "F32" else 2


def hop_for(plan, hosts):
    """A resident pipeline's hop (`stages.model.hop_price`): a token's hidden states in the compute dtype, over the
    links into the followers `hosts` tell."""
    return hop_price(hosts, int(plan.config["hidden_size"]) * compute_itemsize(plan))


def policy_for(plan, memory_arg: str | None, model, resident: bool = False, fraction: float | None = None,
               others: int = 0, kv: tuple | None = None, draft=None, stages: int = 1, hosts=(), replicas: bool = False):
    """(policy, SimRow -> its waiting record, SimRow -> the largest batch that fits rows like it);
    `others`: the group's other processes' memory, priced as admission prices it; `draft`: a draft model's plan;
    `stages`: a pipeline's ranks (its tightest stage's budget, each on its host's memory: `hosts`), or `replicas`."""
    policy, _ = budget_policy(plan, memory_arg, fraction, others=others, resident=resident, kv=kv, draft=draft,
                              stages=stages, hosts=hosts, replicas=replicas)

    def waiting(r) -> Waiting:   # only the prompt's length matters to the policy: a view of no size
        return Waiting(r.row, np.broadcast_to(np.int32(0), (r.prompt,)), r.max_tokens or r.out)

    def max_batch(r) -> int:   # the whole budget in slots of the row's width class, as the job's rows priced it
        s, width = policy.sheet, width_class(r.prompt + r.out)
        return max(1, min(policy.max_rows, s.kv_budget // s.slot(width, width)))
    return policy, waiting, max_batch


def bucket(prompt_tokens: int) -> int:
    return max(int(prompt_tokens), 1).bit_length()


TIERS = ("short (<=128)", "medium (<=640)", "long (>640)")


def tier_of(prompt: int) -> str:
    """Length tiers of the report and of drafts' acceptance: prompts up to 128 tokens, up to 640, longer."""
    return TIERS[0] if prompt <= 128 else TIERS[1] if prompt <= 640 else TIERS[2]


def interleave(queue: deque, length) -> None:
    """Reorder `queue` in place so each bucket's rows are spread evenly through it, each bucket in
    its own order; rows sent back (preempted: `again`) keep the head, in their order. `length(w)` is a
    waiting row's prompt length."""
    buckets: dict[int, list] = {}
    head = [w for w in queue if getattr(w, "again", False)]
    for w in queue:
        if not getattr(w, "again", False):
            buckets.setdefault(bucket(length(w)), []).append(w)
    keyed = [((j + 0.5) / len(ws), b, j, w) for b, ws in buckets.items() for j, w in enumerate(ws)]
    keyed.sort(key=lambda k: k[:3])
    queue.clear()
    queue.extend(head + [k[3] for k in keyed])


def pace(model, bytes_streamed: int, decode_rows: int, context: int, need: int, offset: float = 0.0,
         most: int | None = None, empty: float = 0.0) -> int:
    """Prompt tokens the next pass may prefill in all: what its compute can add under its read time,
    or `need` if more, when that read time hides at least half of `need`. A pass with less room is
    compute-bound whatever it carries: prompts go at full speed (SPILL_PREFILL_TOKENS), so their
    slots fill at once; so do slots left empty (`empty`, their share) where they cost more (`fill_now`).
    With nothing read (resident), or no pass model, SPILL_PREFILL_TOKENS.
    `offset`: the prompt the pass's prompt tokens find cached, on average (`cached`); `most`: what the
    budget priced (the policy's `priced_prefill`), never exceeded."""
    if model is None or not bytes_streamed:
        out = config.prefill_tokens()
    else:
        room = model.prefill_allowance(bytes_streamed, decode_rows, context, offset)
        read = fill_now(empty, room * model.per_prefill_token_s / model.io_s(PassShape(0, 0, 0, bytes_streamed)))
        out = max(room, need) if 2 * room >= need and not read else config.prefill_tokens()
    return min(out, most) if most else out


def fill_now(empty: float, spare: float) -> bool:
    """Empty slots fill at full speed, not within what the read hides (`spare`: its share of the pass), where
    the wait costs more: F slots filled over F x prompt / room passes wait half that each, a row-step at t / n
    a pass, against F x prompt x a prompt token's compute at once: F / n > 2 x room x per token / t."""
    return empty > 2 * spare


def empty(policy) -> float:
    """The share of the slots free while rows wait: a new pool, the end of a wave of like rows, or a job's
    first pass (no pool yet: every slot)."""
    if not policy.queue:
        return 0.0
    slots = max(sum(p.cap for p in policy.pools.values()), len(policy.running))
    return (slots - len(policy.running)) / slots if slots else 1.0


def need(policy) -> int:
    """Prompt tokens a pass must prefill to keep the slots fed: 1.25 x slots x the next waiting rows'
    mean prompt / their mean max_tokens (a row starts as fast as decode frees a slot); every slot a row
    waits for already free: no limit, the last prompts start at once."""
    slots = max(sum(p.cap for p in policy.pools.values()), len(policy.running))
    if len(policy.queue) <= slots - len(policy.running):
        return config.prefill_tokens()
    head = list(islice(policy.queue, policy.window))   # the rows admission looks at: not the whole queue each pass
    prompt, out = sum(prompt_length(w) for w in head), sum(max(w.max_tokens, 1) for w in head)
    return -(-5 * slots * prompt // (4 * out))


def cached(offsets: list[int]) -> float:
    """The prompt cached before the next chunk of the rows prefilling, on average (0 with none): each takes
    an equal share of the pass, and rows that join it start at 0, so this prices the pass on the high side."""
    return sum(offsets) / len(offsets) if offsets else 0.0


def outstanding(prefilling, budget: int, chunk: int) -> int:
    """Prompt tokens the rows still prefilling take in the next pass (`prefilling`: tokens left of each)."""
    step = chunk_for(budget, len(prefilling), chunk)
    return sum(min(step, left) for left in prefilling)


def admit(policy, tokens: int, prefilling: bool = False) -> list:
    """The policy's admissions for the next pass with `tokens` prompt tokens allowed; none while
    prompts already prefilling (`prefilling`) use the allowance up and rows are running (they still move)."""
    if tokens <= 0 and policy.running:
        return []
    policy.prefill_tokens = max(min(tokens, policy.priced_prefill), 1)
    return policy.admit(alone=not prefilling)


def prompt_length(w) -> int:
    """A waiting row's prompt length, whichever record the policy keeps."""
    n = getattr(w, "prompt_tokens", None)
    return n if n is not None else len(w.prompt)
