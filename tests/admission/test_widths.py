"""Decode pools by width class (policy.py): hand-written rows, no model."""

import random

import numpy as np

from spill.admission.policy import BudgetPolicy, Sheet, Waiting, width_class

from .test_policy import MB, run_pass, sheet


def mixed(n_short=20, n_long=20, start=0):
    """Short questions (45 + 128 tokens: class 256) and long documents (900 + 128: class 2048, width 1280),
    alternating as the schedule interleaves them, the first a short one."""
    out = []
    for i in range(n_short + n_long):
        long_ = i % 2 == 1 if i < 2 * min(n_short, n_long) else n_long > n_short
        out.append(Waiting(start + i, np.zeros(900 if long_ else 45, np.int32), 128, [0.0, 1.0, 0, None]))
    return out


def pools(p: BudgetPolicy) -> dict[int, int]:
    """width -> slots"""
    return {width: slots for slots, width in p.shapes()}


def test_an_interleaved_queue_gets_a_pool_per_width_and_short_rows_a_larger_batch():
    p = BudgetPolicy(sheet(slots_mb=40), prefill_tokens=100_000)   # 40 slots of 256 tokens, 8 of 1280
    p.offer(mixed())
    admitted = p.admit()
    # one width (1280) for every row gave 40 // 5 = 8 slots in all; now short rows have their own
    assert pools(p) == {256: 10, 1280: 6} and p.reserved() == 40 * MB <= p.sheet.kv_budget
    short = [w for w in admitted if len(w.prompt) == 45]
    assert len(short) == 10 > 8 and {w.width for w in short} == {256}
    assert {w.width for w in admitted if len(w.prompt) == 900} == {1280}


def test_the_hard_line_preempts_the_newest_rows_and_shrinks_only_their_pool():
    p = BudgetPolicy(sheet(slots_mb=40, hard=0.802), prefill_tokens=100_000)
    p.offer(mixed())
    run_pass(p, live=0)
    newest = list(p.running)[-2:]                           # short rows: the long pool filled first
    preempt, _ = run_pass(p, live=802 * MB)                 # 2 MiB over the guard line: two short slots
    assert preempt == newest[::-1] and pools(p) == {256: 8, 1280: 6}
    assert run_pass(p, live=700 * MB, preempted=preempt) == ([], [])   # both pools are full
    p.finished([0])                                          # a short row leaves: the pool does not grow back
    assert [w for w in p.admit()][0].width == 256 and pools(p) == {256: 8, 1280: 6}


def test_a_class_that_arrives_later_gets_its_share_as_the_pools_running_shrink_to_theirs():
    p = BudgetPolicy(sheet(slots_mb=40), prefill_tokens=100_000)
    p.offer(mixed(n_short=60, n_long=0))
    assert len(p.admit()) == 40 and pools(p) == {256: 40}    # alone, the short class takes the budget
    p.offer(mixed(n_short=0, n_long=20, start=100))
    assert p.admit() == []                                   # no KV free yet; short rows stop refilling
    p.finished(list(range(30)))
    admitted = p.admit()
    assert {w.width for w in admitted} == {1280} and p.reserved() <= p.sheet.kv_budget
    assert pools(p)[256] == 10 and pools(p)[1280] >= 5


def test_the_pools_never_exceed_the_kv_budget_and_every_row_runs_in_its_class():
    rnd = random.Random(3)
    p = BudgetPolicy(sheet(slots_mb=30), max_rows=24, prefill_tokens=3000)
    lengths = [rnd.choice([20, 45, 300, 420, 700, 900, 1500]) for _ in range(300)]
    p.offer([Waiting(i, np.zeros(n, np.int32), rnd.randint(1, 128), []) for i, n in enumerate(lengths)])
    done = 0
    while p.queue or p.running:
        p.admit()
        assert p.reserved() <= p.sheet.kv_budget and sum(s for s, _ in p.shapes()) <= 24
        widths = pools(p)
        for w in p.running.values():
            assert w.full_length <= w.width and w.width in widths and width_class(w.full_length) == width_class(w.width)
        assert len({width_class(w) for w in widths}) == len(widths)
        finished = [r for r in p.running if rnd.random() < 0.2]
        p.finished(finished)
        done += len(finished)
    assert done == 300


def test_attentions_copy_of_one_layer_padded_to_the_widest_pool_is_priced_per_slot():
    s = sheet(slots_mb=40)
    s.layers = 4                                             # a row of one layer at 1280 tokens: 1.25 MiB
    p = BudgetPolicy(s, prefill_tokens=100_000)
    p.offer(mixed())
    p.admit()
    kv = sum(n * w // 256 * MB for n, w in p.shapes())
    copy = sum(n for n, _ in p.shapes()) * 5 * MB // 4
    assert len(p.shapes()) == 2 and p.reserved() == kv + copy <= s.kv_budget < kv + copy + s.slot(256, 1280)
