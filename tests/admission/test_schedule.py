"""The schedule, with a fake clock and fake pass reports: interleaving and the prefill allowance."""

import random
from collections import deque

import pytest

from spill.admission import schedule
from spill.admission.passmodel import PassModel
from spill.admission.simulate import SimRow, simulate

from .test_simulate import FifoPolicy, waiting

MODEL = PassModel(bandwidth=2e9, fixed_s=0.5, per_row_s=0.01, per_prefill_token_s=0.0015,
                  per_context_token_s=1e-5, overlap=0.6, overhead_s=0.05)
BYTES = 4_000_000_000


def three_tiers(n=70):
    """A naive file: 45-token questions, then 420-token summaries, then 900-token documents last."""
    rnd = random.Random(0)
    tiers = [(45, "short")] * n + [(420, "summarize")] * n + [(900, "doc_qa")] * n
    return [SimRow(i, p, rnd.randint(30, 128), t) for i, (p, t) in enumerate(tiers)]


def run(rows, monkeypatch=None, interleave=True):
    if not interleave:
        monkeypatch.setattr(schedule, "interleave", lambda queue, length: None)
    return simulate(rows, FifoPolicy(max_rows=64), waiting, MODEL, BYTES)


def tiers_at_the_end(est) -> set[str]:
    """Tiers with rows running in the last 10% of the job's time."""
    return set().union(*[r for (t, _), r in zip(est.timeline, est.running) if t >= 0.9 * est.total_seconds])


def test_interleave_spreads_each_length_bucket_through_the_queue():
    q = deque(waiting(SimRow(i, n, 8)) for i, n in enumerate([40, 40, 40, 40, 900, 900]))
    schedule.interleave(q, schedule.prompt_length)
    assert [w.row for w in q] == [0, 4, 1, 2, 5, 3]


def test_no_tier_is_left_as_a_wall_at_the_end(monkeypatch):
    est = run(three_tiers())
    assert tiers_at_the_end(est) == {"short", "summarize", "doc_qa"}
    fifo = run(three_tiers(), monkeypatch, interleave=False)     # file order: the long tier alone at the end
    assert tiers_at_the_end(fifo) == {"doc_qa"}


def test_every_pass_keeps_its_prefill_within_the_allowance():
    est = run(three_tiers())
    assert len(est.prefill) == len(est.allowance) == est.passes
    for tokens, allowed in zip(est.prefill, est.allowance):
        assert tokens <= allowed
    assert max(est.prefill) > 512                # passes with room carry several prompts
    assert min(est.allowance) < max(est.allowance)   # the allowance follows the decode batch


def test_the_allowance_comes_from_the_pass_model_and_running_rows_keep_moving():
    io = BYTES / MODEL.bandwidth
    assert schedule.allowance(MODEL, BYTES, 0, 0, 0) == int((io - MODEL.fixed_s) / MODEL.per_prefill_token_s)
    assert schedule.allowance(MODEL, BYTES, 10, 1000, 300) == pytest.approx(
        (io - 0.5 - 0.1 - 0.01) / 0.0015 - 300, abs=1)
    assert schedule.allowance(MODEL, BYTES, 200, 0, 100) == 512 - 100    # compute-bound: a chunk a pass
    p = FifoPolicy(max_rows=8)
    p.offer([waiting(SimRow(0, 100, 8)), waiting(SimRow(1, 100, 8))])
    assert [w.row for w in schedule.admit(p, 0)] == [0]          # nothing running: one row still starts
    assert schedule.admit(p, -50) == []                           # prefills in flight use the allowance up
    assert [w.row for w in schedule.admit(p, 100)] == [1]


def test_a_resident_pass_reads_nothing_so_its_allowance_is_the_fixed_prefill_tokens(monkeypatch):
    monkeypatch.setenv("SPILL_PREFILL_TOKENS", "3000")
    assert schedule.allowance(MODEL, 0, 10, 1000, 300) == 3000 - 300


def test_a_pass_never_starts_more_prompt_tokens_than_the_budget_priced():
    """The calibrated allowance can exceed what the budget priced activations for (a fast disk, a slow
    compute probe): admission caps it, so a pass's prefill stays inside the sheet."""
    from spill.admission.policy import BudgetPolicy
    from .test_policy import rows, sheet
    p = BudgetPolicy(sheet(slots_mb=40), prefill_tokens=300)
    p.offer(rows(*[100] * 10))
    admitted = schedule.admit(p, 10_000)
    assert sum(len(w.prompt) for w in admitted) <= 300 and len(admitted) == 3
    assert schedule.admit(p, 150) and p.prefill_tokens == 150   # a smaller allowance still rules


def test_the_budget_shrinks_the_prefill_allowance_it_prices_to_leave_room_for_kv(make_tiny, monkeypatch):
    """A small machine: 4096 prefill tokens' activations would eat the budget; fewer are priced, down
    to one chunk, and the KV budget is left at least as large as the prefill's share."""
    from spill.streamer.plan import load_plan
    plan = load_plan(make_tiny("llama"))
    monkeypatch.setenv("SPILL_PREFILL_TOKENS", "4096")
    roomy, _ = schedule.budget_policy(plan, "4GB")
    assert roomy.prefill_tokens == 4096
    tight, _ = schedule.budget_policy(plan, "60MB", prefill_chunk=64)
    s = tight.sheet
    assert 64 <= tight.prefill_tokens < 4096
    assert s.kv_budget >= s.fixed["activations"] + s.fixed["prefill_kv"] or tight.prefill_tokens == 64
