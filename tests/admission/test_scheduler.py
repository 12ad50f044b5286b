"""The scheduler: every row's status in one place, the plan of each pass, and what its shape tells the pass model."""

import numpy as np

from spill.admission import schedule
from spill.admission.policy import BudgetPolicy, Waiting
from spill.admission.prices import Sheet
from spill.admission.scheduler import Scheduler, Status

from .test_policy import MB, rows, sheet


def decode_until(sched: Scheduler, status: Status, row: int, live: int = 0, most: int = 20):
    """Plans (each reported with nothing ended) until `row` has `status`; the last plan."""
    for _ in range(most):
        planned = sched.plan()
        sched.reported([], live)
        if sched.status[row] == status:
            return planned
    raise AssertionError(f"row {row} never reached {status.name}")


def test_a_row_goes_waiting_prefilling_decoding_finished_and_the_plan_says_so():
    sched = Scheduler(BudgetPolicy(sheet(slots_mb=50)), chunk=4)
    sched.offer(rows(10, max_tokens=3))
    first = sched.plan()
    assert [w.row for w, _ in first.start] == [0] and first.chunks == {1: 4} and sched.status[0] == Status.PREFILLING
    assert (sched.plan().chunks, sched.status[0]) == ({1: 4}, Status.PREFILLING)
    third = sched.plan()                                   # the prompt's last 2 columns and its first token
    assert third.chunks == {1: 2} and sched.status[0] == Status.DECODING
    fourth = sched.plan()
    assert (fourth.shape.decode_rows, fourth.shape.context_tokens) == (1, 11)   # its prompt and its first token
    sched.reported([0])                                    # the streamer: max_tokens reached
    assert sched.status[0] == Status.FINISHED and not sched.busy


def test_a_preempted_row_is_no_decoding_row_of_any_later_pass_until_it_decodes_again():
    """The context tracker kept a preempted row in `decoding`, its context growing, and after its re-admission
    counted it as prefilling and decoding at once: phantom rows in every observation the refit took."""
    p = BudgetPolicy(sheet(slots_mb=100), max_rows=8)
    sched = Scheduler(p)
    sched.offer(rows(40, 40, max_tokens=50))
    decode_until(sched, Status.DECODING, 1, live=500 * MB)
    dropping = sched.plan()
    assert dropping.shape.decode_rows == 2
    sched.reported([], 902 * MB)                            # above the hard line
    planned = sched.plan()
    assert planned.drop == [1] and sched.status[1] == Status.WAITING
    assert (planned.shape.decode_rows, planned.shape.context_tokens) == (1, 42)   # row 0 alone
    for _ in range(100):                                   # the shrunk pool grows again after a calm spell
        sched.reported([], 500 * MB)
        again = sched.plan()
        assert again.shape.decode_rows == 1                # row 0 alone, however long row 1 waits
        if again.start:
            break
    assert [w.row for w, _ in again.start] == [1] and again.shape.prefill_tokens == 40   # prefilling, not decoding


def dropped_one(prompt: int, max_rows: int = 8) -> Scheduler:
    """Two rows of `prompt` tokens decoding, then the hard line: the next plan drops the newest, row 1."""
    sched = Scheduler(BudgetPolicy(sheet(slots_mb=100), max_rows=max_rows))
    sched.offer(rows(prompt, prompt, max_tokens=50))
    decode_until(sched, Status.DECODING, 1, live=500 * MB)
    sched.reported([], 902 * MB)
    assert sched.plan().drop == [1]
    return sched


def test_preempted_rows_run_before_any_row_queued_after_them():
    """`interleave` re-sorted the whole queue on every TOKENIZED, so a preempted row lost the head it was promised
    to rows of its class queued after it (300 + 50 and 10 + 340 tokens: one width class, two length buckets)."""
    sched = dropped_one(300, max_rows=2)
    p = sched.policy
    sched.offer(rows(*[10] * 6, start=2, max_tokens=340))  # rows come, as the actor interleaves them
    schedule.interleave(p.queue, schedule.prompt_length)
    assert [w.row for w in p.queue][:1] == [1]
    for _ in range(100):                                   # the shrunk pool grows again after a calm spell
        sched.reported([], 500 * MB)
        started = [w.row for w, _ in sched.plan().start]
        if started:
            break
    assert started[:1] == [1]


def test_a_row_ended_by_a_stop_string_as_it_is_preempted_is_not_run_again():
    """The tokenizer ends a row on a stop string in the same pass admission preempts it: it was queued again
    and regenerated to max_tokens with nobody listening."""
    sched = dropped_one(40)
    p = sched.policy
    sched.stopped([1])                                      # its text had ended in the pass before the drop
    sched.reported([], 500 * MB)
    later = [sched.plan() for _ in range(5)]
    assert sched.status[1] == Status.FINISHED and all(1 not in [w.row for w, _ in pl.start] for pl in later)
    assert 1 not in [w.row for w in p.queue]


def run_at_the_edge(sched: Scheduler, fixed: int, passes: int = 200) -> tuple[int, int, list]:
    """A streamer that holds what a plan allocates: the fixed part, every pool and each prefill group's KV at its
    padded width (counted here from the plan's rows, not the sheet). (highest live, rows dropped, ends)."""
    p, s, groups, high, dropped, ended = sched.policy, sched.policy.sheet, {}, 0, [], []
    by_row = {}
    for _ in range(passes):
        if not sched.busy:
            break
        planned = sched.plan()
        dropped += planned.drop
        for w, g in planned.start:
            groups.setdefault(g, []).append(len(w.prompt))
            by_row[w.row] = w
        groups = {g: n for g, n in groups.items() if g in planned.chunks}
        live = fixed + p.reserved() + sum(len(n) * max(n) * s.kv_per_token for n in groups.values())
        high = max(high, live)
        done = [r for r in p.running if sched.status[r] == Status.DECODING
                and sched.generated[r] >= by_row[r].max_tokens]
        ended += done
        sched.reported(done, live)
    return high, len(dropped), ended


def edge_sheet() -> tuple[Sheet, int]:
    """1 KiB of KV a token; 64 prompt tokens a pass, their KV set aside twice (sheet_for's prefill_kv); 1,400 KiB
    of KV budget: ten short rows' pools and a 700-token prompt's slot fit, its prompt's KV beside them does not."""
    kv, working = 1024, 4 * MB
    fixed = {"weights": int(0.78 * working) - 1400 * kv - 128 * kv, "prefill_kv": 128 * kv}
    return Sheet(working, kv_per_token=kv, fixed=fixed), sum(fixed.values())


def test_a_long_prompt_at_the_budgets_edge_is_priced_at_what_it_allocates_and_never_cycles(monkeypatch):
    """A long prompt admitted alone allocated every layer's KV at its full width, priced at 2 x the allowance:
    the group went over the hard line, was preempted as the newest row, admitted again, and cycled."""
    def job():
        s, fixed = edge_sheet()
        p = BudgetPolicy(s, max_rows=16, prefill_tokens=64)
        sched = Scheduler(p, chunk=64)
        short = [Waiting(i, np.zeros(16, np.int32), 20) for i in range(10)]
        sched.offer(short + [Waiting(99, np.zeros(700, np.int32), 8)])
        return sched, fixed, s
    sched, fixed, s = job()
    high, drops, ended = run_at_the_edge(sched, fixed)
    assert sorted(ended) == [*range(10), 99] and drops == 0 and high < s.line(s.hard)
    # the same job with its prompts' KV unpriced (the defect): over the hard line, preempted again and again
    monkeypatch.setattr(Scheduler, "_priced", lambda self, groups: groups)
    sched, fixed, s = job()
    high, drops, _ = run_at_the_edge(sched, fixed, passes=60)
    assert high > s.line(s.hard) and drops >= 2


def test_a_prompt_whose_kv_never_fits_beside_its_slot_is_refused_with_its_sentence():
    s, _ = edge_sheet()
    sched = Scheduler(BudgetPolicy(s, max_rows=8, prefill_tokens=64))
    refused = sched.offer([Waiting(0, np.zeros(900, np.int32), 8)])   # a 1,024-token slot and 772 KiB more
    assert refused and "its KV cache needs" in refused[0][1] and sched.status[0] == Status.FINISHED


def test_a_resident_pipelines_pass_of_decode_rows_alone_runs_rounds_none_past_what_a_row_has_left():
    """Rounds only where nothing prefills; at most the most tokens a row has left, the fewest where rows wait;
    a report of R rounds counts R tokens for every row still decoding."""
    sched = Scheduler(BudgetPolicy(sheet(slots_mb=50), max_rows=2), chunk=64, rounds=8)
    sched.offer(rows(10, 10, max_tokens=12) + rows(10, max_tokens=12, start=2))
    first = sched.plan()
    assert [w.row for w, _ in first.start] == [0, 1] and first.rounds == 1   # a prefill: one step
    sched.reported([])
    waiting = sched.plan()                       # row 2 waits for a slot: no row may end its tokens mid-pass
    assert waiting.rounds == 8 and waiting.shape.context_tokens == 2 * 11
    sched.reported([], rounds=8)
    assert sched.context[0] == sched.context[1] == 19 and sched.generated[0] == 9
    assert sched.plan().rounds == 3              # 3 tokens left each
    sched.reported([0, 1], rounds=3)
    again = sched.plan()
    assert [w.row for w, _ in again.start] == [2] and again.rounds == 1
    sched.reported([])
    assert sched.plan().rounds == 8              # row 2 alone, nothing waits: up to its 11 tokens left
    plain = Scheduler(BudgetPolicy(sheet(slots_mb=50)), chunk=64)
    plain.offer(rows(10, max_tokens=12))
    assert [plain.plan().rounds for _ in range(3)] == [1, 1, 1]   # one process, or a streamed pipeline


def test_a_resident_pipelines_new_prefill_group_opens_as_its_micro_batches_of_rows():
    """A stage runs a prefill group as one micro-batch: cut in M, the prompts cross the stages M at a time."""
    sched = Scheduler(BudgetPolicy(sheet(slots_mb=50), max_rows=8), chunk=64, rounds=8, cut=3)
    sched.offer(rows(10, 11, 12, 10, 11, 12, 10, max_tokens=4))
    first = sched.plan()
    groups = {}
    for w, g in first.start:
        groups.setdefault(g, []).append(w.row)
    assert sorted(map(len, groups.values())) == [2, 2, 3] and sorted(sum(groups.values(), [])) == list(range(7))
    assert first.shape.prefill_groups == 3 and set(first.chunks) == set(groups)
    sched.reported([])
    assert all(sched.status[r] == Status.DECODING for r in range(7)) and sched.plan().shape.decode_rows == 7
    one = Scheduler(BudgetPolicy(sheet(slots_mb=50), max_rows=8), chunk=64)
    one.offer(rows(10, 11, 12, 10, 11, 12, 10, max_tokens=4))
    assert len({g for _, g in one.plan().start}) == 1   # one process: the rows' one group
