"""The FIFO policy with hand-written rows and pass reports."""

from spill.admission.policy import FifoPolicy, Waiting


def rows(*lengths, start=0):
    return [Waiting(start + i, n, ()) for i, n in enumerate(lengths)]


def test_admits_in_order_under_the_prefill_token_budget():
    p = FifoPolicy(max_rows=10, prefill_tokens=100)
    p.offer(rows(40, 50, 30, 5))
    assert [w.row for w in p.admit()] == [0, 1]        # 40 + 50; 30 more would pass 100
    assert [w.row for w in p.admit()] == [2, 3]
    assert p.admit() == []


def test_a_prompt_longer_than_the_budget_still_runs_alone():
    p = FifoPolicy(max_rows=10, prefill_tokens=100)
    p.offer(rows(500, 10))
    assert [w.row for w in p.admit()] == [0]
    assert [w.row for w in p.admit()] == [1]


def test_running_rows_are_capped_and_finished_rows_free_their_slots():
    p = FifoPolicy(max_rows=2, prefill_tokens=1000)
    p.offer(rows(1, 1, 1, 1))
    assert [w.row for w in p.admit()] == [0, 1]
    assert p.admit() == []
    p.finished([1])
    assert [w.row for w in p.admit()] == [2]
    p.clear()
    assert p.admit() == [] and not p.running
