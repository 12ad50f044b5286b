"""--speculate K in the plan: each decode row may carry K drafts, never past its max_tokens, and the drafts a
pass report says a row accepted count as tokens it generated."""

from spill.admission import drafts
from spill.admission.policy import BudgetPolicy
from spill.admission.scheduler import Scheduler, Status

from .test_policy import rows, sheet
from .test_scheduler import decode_until


def test_decode_rows_carry_k_drafts_capped_at_their_max_tokens_and_accepted_drafts_count():
    sched = Scheduler(BudgetPolicy(sheet(slots_mb=50)), chunk=16, speculate=4)
    sched.offer(rows(10, max_tokens=12))
    assert decode_until(sched, Status.DECODING, 0).drafts == {}   # the pass that samples its first token
    assert sched.plan().drafts == {0: 4}                           # 1 generated: up to 4 drafts
    sched.reported([], 0, [[0, 4]])                                # 2 + 4 generated: 6 left
    assert (sched.plan().drafts, sched.context[0]) == ({0: 4}, 17)
    sched.reported([], 0, [[0, 3]])                                # 7 + 3 generated: 2 left, 1 a draft
    assert sched.plan().drafts == {0: 1}
    sched.reported([], 0)                                          # 11 generated: its last token, no draft
    assert sched.plan().drafts == {}


def test_no_drafts_without_speculate():
    sched = Scheduler(BudgetPolicy(sheet(slots_mb=50)), chunk=16)
    sched.offer(rows(10, max_tokens=12))
    decode_until(sched, Status.DECODING, 0)
    assert sched.plan().drafts == {}


def test_auto_drafts_where_the_read_hides_them_and_follows_each_rows_acceptance():
    from spill.admission.passmodel import PassModel
    from spill.typed import AUTO_DRAFTS
    io_bound = PassModel(bandwidth=1e9, fixed_s=0.01, per_row_s=0.001)   # 10 s of read, milliseconds of math
    model = {"now": None}
    sched = Scheduler(BudgetPolicy(sheet(slots_mb=50)), chunk=16, bytes_streamed=10_000_000_000,
                      speculate=AUTO_DRAFTS, model=lambda: model["now"])
    sched.offer(rows(10, 10, max_tokens=200))
    decode_until(sched, Status.DECODING, 1)
    assert sched.plan().drafts == {}              # uncalibrated: no pass model to price drafts with
    sched.reported([], 0)
    model["now"] = io_bound
    assert sched.plan().drafts == {0: 4, 1: 4}    # the prior, 0.5: four drafts each add at least LEAST
    for _ in range(6):                            # row 0 accepts every draft, row 1 none
        sched.reported([], 0, [[0, 4]], [[0, 4], [1, 4]])
        planned = sched.plan()
    assert planned.drafts == {0: drafts.AUTO_MOST, 1: 1}   # the prior keeps a failing row probing, one a pass
    resident = Scheduler(BudgetPolicy(sheet(slots_mb=50)), chunk=16, speculate=AUTO_DRAFTS, model=lambda: io_bound)
    resident.offer(rows(10, max_tokens=200))
    decode_until(resident, Status.DECODING, 0)
    assert resident.plan().drafts == {}           # nothing read: no read for drafts to hide under
