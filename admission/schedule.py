"""The policy a job runs under, built the same way for the admission actor and for the estimate,
so the estimate simulates the policy that will run."""

import numpy as np

from spill import config, memory

from .policy import BudgetPolicy, Waiting, sheet_for


def budget_policy(plan, memory_arg=None, fraction: float | None = None, others: int = 0,
                  prefill_chunk: int = 512) -> tuple[BudgetPolicy, memory.WorkingSet]:
    """The budget policy for `plan` on this machine (`memory_arg`: --memory, else detected)."""
    ws = memory.working_set(memory_arg)
    sheet = sheet_for(plan, ws.bytes, compute_itemsize(plan), prefill_tokens=config.prefill_tokens(),
                      prefill_chunk=prefill_chunk, others=others, fraction=fraction or 0.78,
                      guard=config.guard_line(), hard=config.hard_line())
    return BudgetPolicy(sheet, config.max_rows(), config.prefill_tokens()), ws


def compute_itemsize(plan) -> int:
    """Bytes per float the streamer computes in: float32 on the CPU, the stored dtype on a GPU."""
    import mlx.core as mx
    if mx.default_device() == mx.cpu:
        return 4
    stored = [t.dtype for ts in plan.layers for t in ts if t.dtype in ("BF16", "F16", "F32")]
    return 4 if stored and stored[0] == "F32" else 2


def policy_for(plan, memory_arg: str | None, model):
    """(policy, SimRow -> its waiting record, SimRow -> the largest batch that fits rows like it)."""
    policy, _ = budget_policy(plan, memory_arg)
    s = policy.sheet

    def waiting(r) -> Waiting:   # only the prompt's length matters to the policy: a view of no size
        return Waiting(r.row, np.broadcast_to(np.int32(0), (r.prompt,)), r.out, [])

    def max_batch(r) -> int:
        width = -(-(r.prompt + r.out) // 256) * 256
        return max(1, min(policy.max_rows, s.kv_budget // s.cost(1, width)))
    return policy, waiting, max_batch
