"""The budget policy with hand-written rows and pass reports (no model)."""

import numpy as np

from spill.admission.policy import BudgetPolicy, Waiting
from spill.admission import policy as policy_mod
from spill.admission.prices import Sheet

MB = 2**20


def rows(*lengths, max_tokens=10, start=0):
    return [Waiting(start + i, np.arange(n, dtype=np.int32), max_tokens)
            for i, n in enumerate(lengths)]


def sheet(slots_mb=5, working_set=1000 * MB, **kw):
    """A 1000 MiB machine whose budget leaves `slots_mb` MiB for KV; 256 tokens of KV cost 1 MiB."""
    fixed = {"weights": int(0.78 * working_set) - int(slots_mb * MB)}
    return Sheet(working_set, kv_per_token=MB // 256, fixed=fixed, **kw)


def run_pass(p: BudgetPolicy, live: int, finished=(), preempted=()):
    """What the admission actor does with one pass report: free rows, observe, then decide."""
    p.finished(list(finished))
    p.preempted(list(preempted))
    p.observe(live)
    return p.to_preempt(), [w.row for w in p.admit()]


def test_the_pool_is_sized_from_the_budget_and_never_exceeds_it():
    p = BudgetPolicy(sheet(slots_mb=1.25))
    p.offer(rows(*[54] * 7))
    assert [w.row for w in p.admit()] == [0, 1, 2, 3, 4]     # 64 tokens: 5 slots of 64 tokens, 1/4 MiB each
    assert p.shapes() == [[5, 64]] and p.reserved() == 5 * MB // 4 <= p.sheet.kv_budget
    assert p.admit() == []
    p.finished([0])
    assert [w.row for w in p.admit()] == [5]                 # a freed slot takes the next row
    assert p.reserved() == 5 * MB // 4


def test_each_row_joins_the_pool_of_its_width_class_and_a_full_class_holds_only_its_own_rows():
    p = BudgetPolicy(sheet(slots_mb=6))
    p.offer(rows(600, 54))                                   # 610 tokens: width 640 (2.5 MiB a slot); 64: 64
    assert [(w.row, w.width) for w in p.admit()] == [(0, 640), (1, 64)] and p.shapes() == [[1, 640], [1, 64]]
    p.offer(rows(600, 54, start=2))
    assert [w.row for w in p.admit()] == [3]                 # 3.25 MiB free: the 64 pool grows (1 + 2 fit), 640 not
    assert p.shapes() == [[1, 640], [2, 64]]
    p.finished([0])
    assert [w.row for w in p.admit()] == [2] and p.reserved() <= p.sheet.kv_budget


def test_a_pool_that_took_the_budget_before_other_widths_came_shrinks_at_once_to_its_rows():
    p = BudgetPolicy(sheet(slots_mb=8))
    p.offer(rows(*[10] * 40, max_tokens=54))                 # the job's first rows: all short (width 64)
    p.prefill_tokens = 80                                    # the pass's prompt allowance: 8 of them
    assert len(p.admit()) == 8 and p.shapes() == [[32, 64]]
    p.offer(rows(*[600] * 20, max_tokens=100, start=40))     # then the long rows, far more to generate
    _, admitted = run_pass(p, live=0)
    assert 40 in admitted                                    # they start now, not when the 8 short rows end
    assert p.shapes()[0] == [8, 64] and p.reserved() <= p.sheet.kv_budget


def test_a_row_too_big_for_the_budget_gets_one_sentence_and_the_rest_run():
    p = BudgetPolicy(sheet(slots_mb=2))
    refused = p.offer(rows(5, 600, 5))                       # 610 tokens: 2.4 MiB alone
    assert [(w.row, why.split(":")[0]) for w, why in refused] == [(1, "the prompt is 600 tokens and max_tokens 10")]
    assert "KV budget is 2.0 MiB" in refused[0][1] and "raise --memory or --budget-fraction" in refused[0][1]
    assert [w.row for w in p.admit()] == [0, 2]


def test_a_row_that_fits_only_unrounded_runs_alone():
    s = sheet(slots_mb=2.4)
    s.fixed["weights"], s.fixed["prefill_kv"] = s.fixed["weights"] - 600 * s.kv_per_token, 600 * s.kv_per_token
    p = BudgetPolicy(s)                                      # its prompt's KV while it prefills: set aside
    p.offer(rows(600, 5))                                    # 610 tokens fit 2.4 MiB, 640 would not
    assert [w.row for w in p.admit()] == [0] and p.shapes() == [[1, 610]]


def test_the_guard_line_holds_admission_with_hysteresis():
    p = BudgetPolicy(sheet(slots_mb=10))
    p.offer(rows(5))
    run_pass(p, live=0)
    p.offer(rows(*[5] * 5, start=1))
    assert run_pass(p, live=810 * MB) == ([], [])              # above 80%: hold
    assert run_pass(p, live=790 * MB) == ([], [])              # under 80% but above the 78% budget: still holding
    assert run_pass(p, live=775 * MB) == ([], [1, 2, 3, 4, 5])  # within the budget, where full pools live


def test_above_the_guard_with_nothing_running_one_row_still_runs():
    p = BudgetPolicy(sheet(slots_mb=10))
    p.offer(rows(5, 5, 5))
    assert run_pass(p, live=990 * MB) == ([], [0]) and p.shapes() == [[3, 16]]
    assert run_pass(p, live=990 * MB) == ([], [1, 2])   # the slots the pool holds already


def test_a_pool_made_before_most_rows_came_grows_though_rows_finish_as_fast_as_they_start():
    """The tokenizer's first message had 64 of a job's 256 rows: the pool was made for 64 and never grew, since
    at each pass 2 rows had just finished and 2 more started (the pace of 64 slots), so admission never saw it
    full; a 2-vCPU job ran 64 rows where its budget fitted 184, 3m 56s against 2m 48s."""
    p = BudgetPolicy(sheet(slots_mb=10))                     # 40 slots of 64 tokens
    p.offer(rows(*[54] * 8))
    assert len(p.admit()) == 8 and p.shapes() == [[8, 64]]
    p.offer(rows(*[54] * 32, start=8))                       # the rest of the job's rows
    p.prefill_tokens = 108                                   # the pace: two prompts a pass
    assert run_pass(p, live=0, finished=[0, 1])[1] == [8, 9]
    assert p.shapes() == [[32, 64]]                          # grown into what is free (less the old pool, copied)


def test_a_pool_made_for_the_first_rows_grows_to_its_share_when_the_rest_come():
    """The pool made for the tokenizer's first 64 rows kept free slots while the pace (2 prompts a pass, from its
    64 slots) filled it, so it grew only 32 passes later; the job ran 97 passes where the estimate said 67."""
    p = BudgetPolicy(sheet(slots_mb=10))                     # 40 slots of 64 tokens
    p.offer(rows(*[54] * 8))
    p.prefill_tokens = 108                                   # the pace: two prompts a pass
    assert len(p.admit()) == 2 and p.shapes() == [[8, 64]]
    p.offer(rows(*[54] * 32, start=8))                       # the rest of the job's rows, before the pool filled
    run_pass(p, live=0)
    assert p.shapes() == [[32, 64]]                          # grown into what is free (less the old pool, copied)
    assert run_pass(p, live=0)[1] and p.shapes() == [[32, 64]]   # once: no copy each pass


def test_above_the_guard_rows_fill_the_slots_already_reserved_but_no_pool_grows():
    """A pool of 178 slots held 72 rows when live memory passed the guard line by 10 MiB (memory the sheet did not
    price): admission held the other 106 slots empty until the pool drained, a lifetime of the rows, though the
    streamer held their memory already. Now they fill; only new reservations (a pool made or grown) wait."""
    p = BudgetPolicy(sheet(slots_mb=10), prefill_tokens=40)
    p.offer(rows(*[8] * 100))
    assert run_pass(p, live=500 * MB) == ([], [0, 1, 2, 3, 4]) and p.shapes() == [[80, 32]]
    assert run_pass(p, live=810 * MB) == ([], [5, 6, 7, 8, 9])   # above the guard, under the hard line
    p.offer(rows(*[200] * 3, start=100))
    while len(p.running) < 80:
        assert run_pass(p, live=810 * MB)[1]
    assert p.shapes() == [[80, 32]]                              # full, and no pool for the 210-token rows
    assert run_pass(p, live=700 * MB, finished=list(range(80)))[1][0] == 80 and len(p.pools) == 2


def test_the_hard_line_preempts_the_newest_rows_shrinks_the_pool_and_they_later_finish():
    p = BudgetPolicy(sheet(slots_mb=100), max_rows=8)
    p.offer(rows(*[40] * 8))
    assert run_pass(p, live=500 * MB) == ([], list(range(8)))
    assert p.shapes() == [[8, 64]]
    preempt, admitted = run_pass(p, live=802 * MB)           # 2 MiB over the guard line: 8 slots
    assert (preempt, admitted) == ([], [])                    # (below the hard line: hold only)
    preempt, admitted = run_pass(p, live=902 * MB)           # 102 MiB over: all but the oldest
    assert (preempt, admitted) == ([7, 6, 5, 4, 3, 2, 1], []) and p.shapes() == [[1, 64]]
    assert run_pass(p, live=700 * MB, preempted=[7, 6, 5, 4, 3, 2, 1]) == ([], [])   # the pool is full
    assert run_pass(p, live=600 * MB, finished=[0]) == ([], list(range(1, 8)))       # drained: sized again
    assert run_pass(p, live=600 * MB, finished=range(1, 8)) == ([], [])
    assert not p.running and not p.queue


def test_a_preempted_pool_grows_again_after_passes_within_the_budget_and_waits_twice_as_long_each_time():
    """A preemption shrank the pool to the rows left, and it stayed shrunk until it drained: one spike cost a
    job half its batch for ~15 minutes (`benchmarks/job.py`'s 200-row job). It may grow again once
    REGROW_PASSES passes in a row ran within the budget; each later preemption doubles that wait."""
    wait = policy_mod.REGROW_PASSES
    p = BudgetPolicy(sheet(slots_mb=100), max_rows=8)
    p.offer(rows(*[40] * 20))
    assert run_pass(p, live=500 * MB) == ([], list(range(8)))
    preempt, _ = run_pass(p, live=902 * MB)
    assert preempt == [7, 6, 5, 4, 3, 2, 1] and p.shapes() == [[1, 64]]
    assert run_pass(p, live=700 * MB, preempted=preempt) == ([], [])
    for n in range(wait - 2):
        assert run_pass(p, live=700 * MB) == ([], []), n         # within the budget (780 MiB), still waiting
    assert run_pass(p, live=790 * MB) == ([], [])                # over the budget: the count starts again
    for n in range(wait - 1):
        assert run_pass(p, live=700 * MB) == ([], []), n
    assert run_pass(p, live=700 * MB) == ([], list(range(1, 8))) and p.shapes() == [[8, 64]]
    preempt, _ = run_pass(p, live=902 * MB)                      # a second spike: twice the wait
    assert len(preempt) == 7
    for n in range(2 * wait - 1):
        assert run_pass(p, live=700 * MB, preempted=preempt if n == 0 else ())[1] == [], n
    assert len(run_pass(p, live=700 * MB)[1]) == 7


def test_the_oldest_row_is_never_preempted_so_no_row_starves():
    p = BudgetPolicy(sheet(slots_mb=10))
    p.offer(rows(40, 40, 40))
    run_pass(p, live=0)
    for _ in range(5):                                       # memory stays above the hard line
        preempt, _ = run_pass(p, live=950 * MB)
        assert 0 not in preempt
        run_pass(p, live=950 * MB, preempted=preempt)
    run_pass(p, live=0, finished=[0])
    assert sorted(p.running) == [1, 2]                       # the preempted rows run next
