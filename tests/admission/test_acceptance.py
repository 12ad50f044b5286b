"""Drafts' acceptance by prompt-length tier: kept in the calibration beside the model's, read back from files that
lack it, and where a new row's acceptance starts under auto."""

import json

import numpy as np
import pytest
import structlog

from spill import messages as m
from spill.admission import calibration as cal
from spill.admission import drafts
from spill.admission.calibration import TIERED, Calibration, Calibrator
from spill.admission.passmodel import PassModel, PassShape
from spill.admission.policy import BudgetPolicy, Waiting
from spill.admission.scheduler import Scheduler, Status
from spill.typed import AUTO_DRAFTS

from .test_policy import rows, sheet
from .test_scheduler import decode_until

KEY = "a|float32|cpu|m1"
SHORT, MEDIUM, LONG = "short (<=128)", "medium (<=640)", "long (>640)"


def report(drafted, accepted):
    return m.Pass(0, 1, seconds=0.5, wait_s=0.0, compute_s=0.45, decode_rows=3, prefill_tokens=0, emitted=3,
                  finished=[], active_memory=0, peak_memory=0, bytes_streamed=4096, drafted=drafted,
                  accepted=accepted, columns=5)


@pytest.fixture
def hook(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    h = Calibrator(structlog.get_logger())
    h.cal = Calibration(KEY, PassModel(bandwidth=2e9, per_row_s=0.01))
    return h


def test_each_rows_drafts_count_in_its_prompts_tier_and_in_all(hook):
    # row 1 (40 prompt tokens) takes its 4; row 2 (300) 1 and the rejected one; row 3 (900) its first rejected;
    # row 4's prompt is not known: it counts in all alone
    hook.observe(PassShape(4, 0, 30, 4096), report([[1, 4], [2, 4], [3, 2], [4, 3]], [[1, 4], [2, 1], [4, 3]]),
                 {1: 40, 2: 300, 3: 900})
    back = Calibration.load(KEY)
    tiers = back.draft_counts["tiers"]
    assert {t: (d["accepted"], d["tried"], d["count"]) for t, d in tiers.items()} == {
        SHORT: (4, 4, 4), MEDIUM: (1, 2, 2), LONG: (0, 1, 1)}
    assert (back.draft_counts["accepted"], back.draft_counts["count"]) == (8, 10)
    assert back.tier_acceptance() == {}                      # fewer than TIERED drafts tried in any tier


def test_a_tiers_own_acceptance_counts_once_it_has_tried_enough_drafts(hook):
    # short rows accept 2 of every 4 drafted (3 tried), long rows every draft
    passes = TIERED // 3 + 1
    for _ in range(passes):
        hook.observe(PassShape(2, 0, 30, 4096), report([[1, 4], [2, 4]], [[1, 2], [2, 4]]), {1: 60, 2: 2000})
    back = Calibration.load(KEY)
    assert back.tier_acceptance() == {SHORT: pytest.approx(2 / 3), LONG: pytest.approx(1.0)}
    assert back.acceptance == pytest.approx(6 / 7)
    # a new row starts from its tier's; a tier not measured from the prior, not from other kinds of rows'
    assert hook.starting_rates([60, 300, 2000]) == pytest.approx([2 / 3, drafts.PRIOR, 1.0])
    hook.cal = Calibration(KEY, PassModel(bandwidth=2e9))
    assert hook.starting_rates([60, 2000]) == [drafts.PRIOR, drafts.PRIOR]


def test_a_draft_models_acceptance_is_kept_by_tier_for_its_pair_alone(hook, tmp_path):
    hook.reset("", draft=str(tmp_path / "draft"))
    pair = cal.model_key(tmp_path / "draft")
    for _ in range(TIERED):
        hook.observe(PassShape(1, 0, 30, 4096), report([[1, 2]], [[1, 2]]), {1: 500})
    back = Calibration.load(KEY)
    assert back.tier_acceptance(pair) == {MEDIUM: 1.0} and back.tier_acceptance() == {}
    assert back.counts(pair)["tiers"][MEDIUM]["count"] == 2 * TIERED
    assert hook.starting_rates([500, 50]) == [1.0, drafts.PRIOR]   # the pair's medium tier; its short has none


def test_a_calibration_stored_without_tiers_loads_with_its_acceptance_in_all(hook):
    hook.observe(PassShape(1, 0, 30, 4096), report([[1, 4]], [[1, 1]]), {1: 40})
    stored = json.loads(cal.store_path(KEY).read_text())
    del stored["drafts"]["tiers"]
    stored["pairs"] = {"p": {"accepted": 3.0, "tried": 4.0, "count": 4}, "q": {"accepted": 1, "tried": 2, "count": 2,
                                                                              "tiers": ["not", "a", "dict"]}}
    cal.store_path(KEY).write_text(json.dumps(stored))
    back = Calibration.load(KEY)
    assert back is not None and back.acceptance == pytest.approx(1 / 2) and back.tier_acceptance() == {}
    assert back.acceptance_of("p") == pytest.approx(3 / 4) and back.tier_acceptance("p") == {}
    assert back.acceptance_of("q") == pytest.approx(1 / 2)
    back.observe_drafts([[1, 4]], [[1, 4]], "p", {1: 40})    # and it goes on counting, by tier too
    assert back.counts("p")["tiers"][SHORT]["count"] == 4


def io_bound(priors=None, policy=None) -> Scheduler:
    """Auto drafts under 10 s of read a pass and milliseconds of math: drafts pay wherever a row takes them."""
    return Scheduler(policy or BudgetPolicy(sheet(slots_mb=50)), chunk=1024, bytes_streamed=10_000_000_000,
                     speculate=AUTO_DRAFTS, model=lambda: PassModel(bandwidth=1e9, fixed_s=0.01, per_row_s=0.001),
                     priors=priors)


def test_auto_starts_each_new_row_from_its_acceptance_before_its_own_drafts():
    rates = {0: 0.9, 1: 0.3, 2: 0.01}                        # copies of a passage; an open question; a rare one
    sched = io_bound(lambda ids: [rates[r] for r in ids])
    sched.offer(rows(10, 10, 10, max_tokens=200))
    decode_until(sched, Status.DECODING, 2)
    # the j-th draft is carried while a^j >= LEAST: 0.9 up to AUTO_MOST, 0.3 two; 0.01 is probed at PROBE: one
    assert sched.plan().drafts == {0: drafts.AUTO_MOST, 1: 2, 2: 1}
    flat = io_bound()
    flat.offer(rows(10, 10, 10, max_tokens=200))
    decode_until(flat, Status.DECODING, 2)
    assert flat.plan().drafts == {0: 4, 1: 4, 2: 4}        # no measure: every row from the prior, 0.5


def test_the_admission_actors_scheduler_starts_rows_from_their_tiers_measured_acceptance(hook):
    for _ in range(TIERED):                                  # short rows accept nothing, long ones all
        hook.observe(PassShape(2, 0, 30, 4096), report([[1, 4], [2, 4]], [[2, 4]]), {1: 10, 2: 900})
    policy = BudgetPolicy(sheet(slots_mb=50))
    sched = io_bound(hook.priors(policy), policy)
    sched.offer(rows(10, 900, max_tokens=200))
    decode_until(sched, Status.DECODING, 1)
    planned = sched.plan()
    assert planned.drafts == {0: 1, 1: drafts.AUTO_MOST}     # the short row's tier never accepts: a probe alone
    for _ in range(3):                                       # its own drafts take over: three rejected, none more
        sched.reported([], 0, [[1, planned.drafts[1]]], [[0, 1], [1, planned.drafts[1]]])
        planned = sched.plan()
    assert planned.drafts == {1: drafts.AUTO_MOST}


def test_each_ended_rows_own_acceptance_over_its_life_is_kept_in_its_tiers_spread(hook):
    sched = io_bound()
    sched.offer([Waiting(0, np.arange(10, dtype=np.int32), 41), Waiting(1, np.arange(10, dtype=np.int32), 9),
                 Waiting(2, np.arange(900, dtype=np.int32), 200), Waiting(3, np.arange(10, dtype=np.int32), 200)])
    decode_until(sched, Status.DECODING, 3)
    for i in range(8):   # rows 0 and 3 accept their 4 drafts a pass, row 1 none; row 2 its one draft for 3 passes
        sched.plan()
        drafted, accepted = [[0, 4], [1, 4], [3, 4]] + [[2, 1]] * (i < 3), [[0, 4], [3, 4]] + [[2, 1]] * (i < 3)
        ended = sched.reported([2] if i == 2 else [0, 1, 3] if i == 7 else [], 0, accepted, drafted)
        hook.observe(PassShape(4, 0, 30, 4096), report(drafted, accepted), {0: 10, 1: 10, 2: 900, 3: 10}, ended)
    # rows 0 and 1 ran their whole max_tokens (41 and 9 tokens); row 3 ended early (41 of 200: its text's end), row 2
    # too, and had tried 3 drafts in all (fewer than ROW_TRIED): the estimate runs every row to its max_tokens
    stored = Calibration.load(KEY)
    assert stored.counts()["tiers"][SHORT]["rows"] == [1.0, 0.0] and "rows" not in stored.counts()["tiers"][LONG]
    assert stored.tier_rows() == {}   # fewer than ROWS_TIERED rows kept
    hook.observe(PassShape(1, 0, 30, 4096), report([[9, 4]], [[9, 1]]), {9: 40}, [(40, 4, 8)] * cal.ROWS_TIERED)
    assert Calibration.load(KEY).tier_rows() == {SHORT: [0.0] + [0.5] * cal.ROWS_TIERED + [1.0]}
