"""The prompt allowance a pass may carry, chosen from the job's rows (admission/allowance.py)."""

import random

import numpy as np

from spill.admission import allowance, schedule
from spill.admission.policy import BudgetPolicy, Waiting
from spill.admission.prices import Sheet
from spill.admission.simulate import SimRow, simulate

from .test_schedule import MODEL
from .test_simulate import waiting

MB = 2**20


def price(kv_at_zero=72 * MB, per_token=MB // 32):
    """A sheet whose every prompt token priced costs 1/32 MiB of the KV budget (1 MiB per 256 tokens of KV)."""
    def sheet(tokens: int) -> Sheet:
        kv = MB // 256   # of each prompt token's price, twice its KV is the prompts' (prefill_kv), as sheet_for has it
        fixed = {"weights": int(0.78 * 1000 * MB) - kv_at_zero, "activations": tokens * (per_token - 2 * kv),
                 "prefill_kv": 2 * tokens * kv}
        return Sheet(1000 * MB, kv_per_token=kv, fixed=fixed)
    return sheet


def job(n, prompt, out):
    return [Waiting(i, np.zeros(prompt, np.int32), out) for i in range(n)]


def test_the_allowance_that_advances_the_most_rows_is_chosen_not_the_most():
    """1,000 rows of 64 + 16 tokens (a slot of 80 tokens: 0.31 MiB): 25 rows' KV at 2,048 tokens, 128 at 1,024,
    179 at 512. The job takes max(1000 x 80 / tokens, 1000 x 16 / fit) + fit x 80 / tokens passes: 641, 135, 184."""
    p = BudgetPolicy(price()(2048), max_rows=1000, prefill_tokens=2048, price=price(), least=128)
    p.offer(job(1000, 64, 16))
    assert p.priced_prefill == 1024 and p.sheet.fixed["activations"] + p.sheet.fixed["prefill_kv"] == 1024 * MB // 32
    assert p.sheet.kv_budget == 40 * MB   # the KV the allowance no longer holds is the pools'


def test_a_job_whose_rows_all_fit_keeps_the_most_so_they_start_at_once():
    p = BudgetPolicy(price()(2048), prefill_tokens=2048, price=price(), least=128)
    p.offer(job(20, 64, 16))
    assert p.priced_prefill == 2048


def test_long_outputs_want_room_for_rows_short_ones_want_prompts_started():
    rows = lambda n, prompt, out: [(prompt, out, 80 * MB // 256)] * n
    tokens, _ = allowance.choose(rows(1000, 64, 256), price(), 2048, 128, 1000)
    assert tokens == 128                      # a row holds its slot for 256 passes: room for rows wins (1,316 passes
    #                                           against 1,319 at 256 and 2,049 at 2,048)
    tokens, _ = allowance.choose(rows(1000, 64, 1), price(), 2048, 128, 1000)
    assert tokens == 2048                     # rows leave after their prompt: starting prompts wins


def test_a_new_choice_never_leaves_the_pools_less_kv_than_they_hold():
    """Rows already running hold their pools; many more rows of one token each would want 1,024 tokens a pass,
    which would leave less KV than the pools reserve: the allowance stays where they fit."""
    p = BudgetPolicy(price()(2048), max_rows=1000, prefill_tokens=2048, price=price(), least=128)
    p.offer(job(1000, 64, 256))
    assert p.priced_prefill == 128 and p.admit()
    more = [Waiting(5000 + i, np.zeros(64, np.int32), 1) for i in range(20_000)]
    known = [(len(w.prompt), w.max_tokens, p.sheet.slot(*[schedule.width_class(w.full_length)] * 2))
             for w in [*p.running.values(), *p.queue, *more]]
    assert allowance.choose(known, price(), 2048, 128, 1000)[0] == 1024   # with nothing reserved
    p.offer(more)
    assert p.priced_prefill == 128 and p.reserved() <= p.sheet.kv_budget


def test_without_a_price_the_allowance_is_fixed():
    p = BudgetPolicy(price()(2048), max_rows=1000, prefill_tokens=2048)
    p.offer(job(1000, 64, 16))
    assert p.priced_prefill == 2048


def test_the_estimate_runs_the_chosen_allowance_and_no_pass_carries_more():
    """The schedule's pace may allow more than the sheet priced (a fast disk): every pass's prompt tokens stay
    within the chosen allowance, and the job is shorter than at the most."""
    rnd = random.Random(0)
    rows = [SimRow(i, rnd.randint(40, 90), rnd.randint(12, 20)) for i in range(600)]
    chosen = BudgetPolicy(price()(2048), max_rows=1000, prefill_tokens=2048, price=price(), least=128)
    est = simulate(rows, chosen, waiting, MODEL, 8_000_000_000)
    assert chosen.priced_prefill == 1024 and max(est.prefill) <= 1024 < schedule.pace(MODEL, 8_000_000_000, 0, 0, 0)
    fixed = simulate(rows, BudgetPolicy(price()(2048), max_rows=1000, prefill_tokens=2048), waiting, MODEL, 8_000_000_000)
    assert max(fixed.prefill) > 1024
    assert est.total_seconds < 0.9 * fixed.total_seconds


def test_prompts_longer_than_the_allowance_prefill_at_most_the_allowance_a_pass():
    """A 900-token prompt starts alone and prefills over several passes: with a pace above what the sheet
    priced (a fast disk), it took a 512-token chunk a pass and new prompts started beside it."""
    rows = [SimRow(i, 900, 16) for i in range(40)]
    p = BudgetPolicy(price(kv_at_zero=400 * MB)(256), max_rows=1000, prefill_tokens=256)
    est = simulate(rows, p, waiting, MODEL, 8_000_000_000)
    assert max(est.prefill) == 256 < schedule.pace(MODEL, 8_000_000_000, 0, 0, 0)


def test_the_actor_paces_the_streamer_within_what_the_sheet_priced(monkeypatch):
    """Without a calibration the pace is SPILL_PREFILL_TOKENS; the pace the scheduler plans with stays within the allowance."""
    from spill.admission.calibration import Calibrator
    monkeypatch.setenv("SPILL_PREFILL_TOKENS", "4096")
    cal = Calibrator(log=None)
    assert cal.pace(0, 0, 0, most=256) == 256


def test_running_rows_have_no_prompt_left_to_start_as_the_live_estimate_offers_them():
    """Mid-job, the live estimate offers each running row with no prompt (it is prefilled); admission's own choice
    counts its running rows the same way, so the two choose alike: here 512, where their prompts counted gave 1,024."""
    sheet = price(kv_at_zero=200 * MB)
    p = BudgetPolicy(sheet(2048), max_rows=1000, prefill_tokens=2048, price=sheet, least=128)
    p.offer([Waiting(i, np.zeros(300, np.int32), 200) for i in range(100)])
    for _ in range(30):
        p.admit()
    assert len(p.running) == 84
    p.offer([Waiting(1000 + i, np.zeros(64, np.int32), 16) for i in range(100)])
    slot = lambda w: p.sheet.slot(*[schedule.width_class(w.full_length)] * 2)
    live = [(0, w.max_tokens, slot(w)) for w in p.running.values()] + [(len(w.prompt), w.max_tokens, slot(w))
                                                                       for w in p.queue]
    assert p.priced_prefill == allowance.choose(live, sheet, 2048, 128, 1000, p.reserved())[0] == 512
