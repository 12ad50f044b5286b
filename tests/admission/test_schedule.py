"""The schedule, with a fake clock and fake pass reports: interleaving and the prefill allowance."""

import random
from collections import deque
from dataclasses import replace

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
    """Tiers with rows running in the last 15% of the job's time (with no pace, the short tier's last row
    ends at 89% interleaved, at 80% in file order)."""
    return set().union(*[r for (t, _), r in zip(est.timeline, est.running) if t >= 0.85 * est.total_seconds])


def test_interleave_spreads_each_length_bucket_through_the_queue():
    q = deque(waiting(SimRow(i, n, 8)) for i, n in enumerate([40, 40, 40, 40, 900, 900]))
    schedule.interleave(q, schedule.prompt_length)
    assert [w.row for w in q] == [0, 4, 1, 2, 5, 3]


def test_no_tier_is_left_as_a_wall_at_the_end(monkeypatch):
    est = run(three_tiers())
    assert tiers_at_the_end(est) == {"short", "summarize", "doc_qa"}
    # prompts at full speed (no pace), file order leaves the long tier alone at the end; interleaved, not
    monkeypatch.setattr(schedule, "pace", lambda *a, **k: 4096)
    assert tiers_at_the_end(run(three_tiers())) == {"short", "summarize", "doc_qa"}
    fifo = run(three_tiers(), monkeypatch, interleave=False)
    assert "doc_qa" in tiers_at_the_end(fifo) and "short" not in tiers_at_the_end(fifo)


def test_every_pass_keeps_its_prefill_within_the_allowance():
    est = run(three_tiers())
    assert len(est.prefill) == len(est.allowance) == est.passes
    for tokens, allowed in zip(est.prefill, est.allowance):
        assert tokens <= allowed
    assert max(est.prefill) > 512                # passes with room carry several prompts
    assert min(est.allowance) < max(est.allowance)   # the allowance follows the decode batch


# a 2-core machine on a slow disk (the 200-row job's calibration): 3.8 s of read, 2 s of fixed compute
SLOW = PassModel(bandwidth=0.7e9, fixed_s=2.0, per_row_s=0.029, per_prefill_token_s=0.029,
                 per_context_token_s=2e-6, overlap=0.9, overhead_s=0.05)


def test_on_a_slow_disk_prompts_prefill_under_the_read_not_a_512_token_chunk_a_pass(monkeypatch):
    """Each prompt took a 512-token chunk a pass whatever the room (15 s passes against 3.8 s of
    read); the pace now shares out what the read hides, so the job is shorter."""
    from spill.admission.policy import BudgetPolicy
    from spill.admission.prices import Sheet
    def policy():   # 220 MiB of KV at 22 KiB a token: about 13 rows of the three tiers at once, prompts' KV apart
        kv = 22 * 1024
        return BudgetPolicy(Sheet(220 * 2**20 + 2048 * kv, kv_per_token=kv, fraction=1.0,
                                  fixed={"prefill_kv": 2048 * kv}), prefill_tokens=1024)
    rows = [SimRow(r.row, r.prompt, 128, r.tier) for r in three_tiers(40)]
    est = simulate(rows, policy(), waiting, SLOW, 2_670_000_000)
    carried = [p for p in est.prefill if p]
    assert sorted(carried)[len(carried) // 2] < 200               # under the read: ~60 tokens a pass
    assert sum(p >= 512 for p in carried) < 0.05 * len(carried)   # full speed only once nothing waits
    monkeypatch.setattr(schedule, "pace", lambda *a, **k: 1024)       # the old schedule: prompts at full speed
    full = simulate(rows, policy(), waiting, SLOW, 2_670_000_000)
    assert max(full.prefill) >= 512
    assert est.total_seconds < 0.98 * full.total_seconds        # 3% shorter here; 6% on the 200-row job


def test_the_pace_comes_from_the_pass_model_and_running_rows_keep_moving(monkeypatch):
    monkeypatch.setenv("SPILL_PREFILL_TOKENS", "4096")
    io = BYTES / MODEL.bandwidth
    assert schedule.pace(MODEL, BYTES, 0, 0, 0) == int((io - MODEL.fixed_s) / MODEL.per_prefill_token_s)
    assert schedule.pace(MODEL, BYTES, 10, 1000, 0) == pytest.approx((io - 0.5 - 0.1 - 0.01) / 0.0015, abs=1)
    room = schedule.pace(MODEL, BYTES, 10, 1000, 0)
    assert schedule.pace(MODEL, BYTES, 10, 1000, room + 200) == room + 200     # what keeps the slots fed
    assert schedule.pace(MODEL, BYTES, 200, 0, 100) == 4096    # compute-bound: prompts at full speed
    assert schedule.outstanding([100, 20], 64, 512) == 32 + 20  # an equal share, at least 32 tokens a row
    assert schedule.outstanding([900], 10_000, 512) == 512     # at most a chunk a row
    p = FifoPolicy(max_rows=8)
    p.offer([waiting(SimRow(0, 100, 8)), waiting(SimRow(1, 100, 8))])
    assert [w.row for w in schedule.admit(p, 0)] == [0]          # nothing running: one row still starts
    assert schedule.admit(p, -50) == []                           # prefills in flight use the allowance up
    assert [w.row for w in schedule.admit(p, 100)] == [1]


def test_the_need_keeps_the_slots_fed_and_is_unbounded_once_nothing_waits_for_a_slot(monkeypatch):
    monkeypatch.setenv("SPILL_PREFILL_TOKENS", "4096")
    p = FifoPolicy(max_rows=4)
    p.offer([waiting(SimRow(i, 100, 50)) for i in range(10)])
    schedule.admit(p, 10_000)
    assert len(p.running) == 4 and len(p.queue) == 6
    assert schedule.need(p) == -(-5 * 4 * 100 // (4 * 50))     # 1.25 x 4 slots x 100 / 50 = 10
    p.queue.extend(waiting(SimRow(100 + i, 5000, 50)) for i in range(10_000))   # far down the queue
    assert schedule.need(p) == 10    # the rows admission looks at next (its window), not a sum over the queue
    p.queue = type(p.queue)(list(p.queue)[:6])
    p.finished([w for w in list(p.running)[:3]])
    p.queue = type(p.queue)(list(p.queue)[:3])                # 3 waiting, 3 slots free
    assert schedule.need(p) == 4096


def test_slots_left_empty_fill_at_full_speed_where_waiting_for_the_read_costs_more(monkeypatch):
    """A new pool (or one a wave of like rows left empty) with rows waiting: the prompts go at full speed, not
    within the read (on the VM, lean45 32 + 96, a 32-token row a pass into 64 empty slots for 24 passes); a
    slot or two free: within the read, as the slow disk's job wants (below)."""
    monkeypatch.setenv("SPILL_PREFILL_TOKENS", "4096")
    room = schedule.pace(MODEL, BYTES, 100, 0, 0)             # (2 - 0.5 - 100 x 0.01) / 0.0015 = 333: a quarter of the read
    p = FifoPolicy(max_rows=8)
    p.offer([waiting(SimRow(i, 100, 50)) for i in range(20)])
    assert schedule.empty(p) == 1.0                           # a job's first pass: no pool yet, every slot free
    busy = replace(MODEL, fixed_s=1.8)                        # compute-bound: its read hides 133 prompt tokens
    assert schedule.pace(busy, BYTES, 0, 0, schedule.need(p), empty=schedule.empty(p)) == 4096
    schedule.admit(p, 200)
    assert len(p.running) == 2 and schedule.empty(p) == 6 / 8
    assert schedule.pace(MODEL, BYTES, 100, 0, schedule.need(p), empty=schedule.empty(p)) == 4096
    schedule.admit(p, 500)
    assert len(p.running) == 7 and schedule.empty(p) == 1 / 8
    assert schedule.pace(MODEL, BYTES, 100, 0, schedule.need(p), empty=schedule.empty(p)) == room
    p.queue.clear()
    assert schedule.empty(p) == 0                             # nobody waits: no slot is empty for want of a start


def test_a_resident_pass_reads_nothing_so_its_pace_is_the_fixed_prefill_tokens(monkeypatch):
    monkeypatch.setenv("SPILL_PREFILL_TOKENS", "3000")
    assert schedule.pace(MODEL, 0, 10, 1000, 300) == 3000


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


def test_a_cuda_gpus_budget_is_its_memory_with_the_hosts_apart(make_tiny, monkeypatch, on_device):
    """As the supervisor passes the device down there: the GPU's memory is the working set (--memory sets it),
    the host's (a cgroup's limit, else physical memory) holds the reader's buffers and the other processes."""
    from spill import memory, platform
    from spill.streamer.plan import load_plan
    on_device("gpu-NVIDIA H200", 4 << 30)
    monkeypatch.setattr(platform.sys, "platform", "linux")
    plan = load_plan(make_tiny("llama"))
    policy, ws = schedule.budget_policy(plan, others=1 << 20)
    assert (ws.bytes, ws.source) == (4 << 30, "cuda") and policy.sheet.host_set == memory.host_set().bytes
    assert policy.sheet.host["others"] == 1 << 20 and "others" not in policy.sheet.fixed
    capped = schedule.budget_policy(plan, "1GiB")[0].sheet
    assert capped.working_set == 1 << 30 and capped.host_set == memory.host_set().bytes
    line = memory.describe_line(memory.describe({"memory": None}))
    assert "working set 4.0 GiB (cuda)" in line and "the host's" in line
    on_device("cpu")
    assert schedule.budget_policy(plan, "1GiB")[0].sheet.host_set == 0   # one budget elsewhere


def test_a_cuda_gpus_own_memory_is_budgeted_nearer_its_size_and_the_hosts_as_before(make_tiny, monkeypatch, on_device):
    """No page cache lives in a discrete GPU's memory: its budget is 90% (lines at 93 and 97%), one layer of
    weights is in flight, and the host's budget stays 78%; --budget-fraction still sets the GPU's."""
    from spill import memory, platform
    from spill.streamer.plan import load_plan
    plan = load_plan(make_tiny("llama"))
    cpu = schedule.budget_policy(plan, "1GiB")[0].sheet
    on_device("gpu-NVIDIA H200", 4 << 30)
    monkeypatch.setattr(platform.sys, "platform", "linux")
    gpu = schedule.budget_policy(plan, "1GiB")[0].sheet
    assert (cpu.fraction, cpu.guard, cpu.hard) == (0.78, 0.80, 0.90)
    assert (gpu.fraction, gpu.guard, gpu.hard, gpu.host_fraction) == (0.90, 0.93, 0.97, 0.78)
    assert 4 * gpu.fixed["layers"] == cpu.fixed["layers"] > 0   # one bf16 layer against two in f32
    assert schedule.budget_policy(plan, "1GiB", fraction=0.5)[0].sheet.fraction == 0.5
    assert "budget 90%" in memory.describe_line(memory.describe({"memory": None}))


@pytest.mark.parametrize("gpu", [False, True])
def test_a_budget_fraction_set_above_the_guard_line_lifts_the_lines_with_it(make_tiny, monkeypatch, gpu, on_device):
    """--budget-fraction 0.95 left the guard at 80% (93% on a CUDA GPU): every pass above it held, so the pools
    never grew past it, and the hard line at 90% preempted rows the budget had priced in. The lines keep their
    distance above a budget set higher; SPILL_GUARD_LINE / SPILL_HARD_LINE still set them outright."""
    from spill import platform
    from spill.streamer.plan import load_plan
    if gpu:
        on_device("gpu-NVIDIA H200", 4 << 30)
        monkeypatch.setattr(platform.sys, "platform", "linux")
    plan = load_plan(make_tiny("llama"))
    policy = schedule.budget_policy(plan, "1GiB", fraction=0.95)[0]
    s = policy.sheet
    assert s.fraction < s.guard < s.hard <= 1.0
    policy.observe(int(0.94 * s.working_set))    # within the budget asked for
    assert not policy.holding
    default = schedule.budget_policy(plan, "1GiB")[0].sheet
    assert (default.guard, default.hard) == ((0.93, 0.97) if gpu else (0.80, 0.90))
    monkeypatch.setenv("SPILL_GUARD_LINE", "0.85")
    assert schedule.budget_policy(plan, "1GiB", fraction=0.95)[0].sheet.guard == 0.85
