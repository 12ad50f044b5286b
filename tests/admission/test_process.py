"""What the admission actor tells the coordinator after a pass (its report, no sockets)."""

from types import SimpleNamespace

from spill import messages as m
from spill.admission.calibration import Calibration, Calibrator
from spill.admission.passmodel import PassModel
from spill.admission.policy import BudgetPolicy
from spill.admission.process import report

from .test_policy import MB, rows, run_pass, sheet


def test_the_report_carries_the_lines_the_hold_and_the_rows_preempted():
    p = BudgetPolicy(sheet(slots_mb=100), max_rows=8)
    p.offer(rows(*[40] * 8))
    run_pass(p, live=500 * MB)
    p.offer(rows(40, 40, start=8))
    preempt, _ = run_pass(p, live=902 * MB)                  # above the hard line: the 7 newest go
    requeued = p.preempted(preempt)                           # the next pass reports them dropped
    p.observe(790 * MB)                                       # under the guard, above it less hysteresis: held
    calibrator = Calibrator(SimpleNamespace(info=print, warning=print))
    calibrator.cal = Calibration("k", PassModel(bandwidth=3.5e9))
    told = m.decode(m.encode(report(2, 9, p, 64 * MB, requeued, calibrator, "job1")))
    assert told == m.Budget(2, 9, 1000 * MB, int(0.78 * 1000 * MB), int(0.80 * 1000 * MB), int(0.90 * 1000 * MB),
                            64 * MB, held_rows=9, preempted_rows=7, probe_bandwidth=3.5e9, job="job1")
    p.observe(700 * MB)                                        # below guard less hysteresis: no hold
    assert report(2, 10, p, 0, 0, Calibrator(None), "job1").held_rows == 0
    assert report(2, 10, p, 0, 0, Calibrator(None), "job1").probe_bandwidth == 0.0   # no calibration: no figure
