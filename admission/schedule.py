"""The policy a job runs under, built the same way for the admission actor and for the estimate,
so the estimate simulates the policy that will run."""

from spill import config

from .policy import FifoPolicy, Waiting


def policy_for(plan, memory: str | None, model):
    """(policy, SimRow -> its waiting record, SimRow -> the largest batch that fits rows like it)."""
    policy = FifoPolicy(max_rows=config.max_rows(), prefill_tokens=config.prefill_tokens())
    return policy, lambda r: Waiting(r.row, r.prompt, ()), lambda r: policy.max_rows
