"""Decode pools by width class (policy.py): hand-written rows, no model."""

import random

import numpy as np

from spill.admission.policy import BudgetPolicy, Waiting, width_class

from .test_policy import MB, run_pass, sheet


def mixed(n_short=20, n_long=20, start=0):
    """Short questions (45 + 128 tokens: class 192, 0.75 MiB a slot) and long documents (900 + 128: class 1280),
    alternating as the schedule interleaves them, the first a short one."""
    out = []
    for i in range(n_short + n_long):
        long_ = i % 2 == 1 if i < 2 * min(n_short, n_long) else n_long > n_short
        out.append(Waiting(start + i, np.zeros(900 if long_ else 45, np.int32), 128))
    return out


def pools(p: BudgetPolicy) -> dict[int, int]:
    """width -> slots"""
    return {width: slots for slots, width in p.shapes()}


def test_an_interleaved_queue_gets_a_pool_per_width_and_short_rows_a_larger_batch():
    p = BudgetPolicy(sheet(slots_mb=40), prefill_tokens=100_000)   # 53 slots of 192 tokens, 8 of 1280
    p.offer(mixed())
    admitted = p.admit()
    # one width (1280) for every row gave 40 // 5 = 8 slots in all; now short rows have their own:
    # a slot each in turn to 6 pairs (34.5 MiB), then the 5.5 MiB left to 7 more short ones
    assert pools(p) == {192: 13, 1280: 6} and p.reserved() == (13 * 192 + 6 * 1280) * MB // 256 <= p.sheet.kv_budget
    short = [w for w in admitted if len(w.prompt) == 45]
    assert len(short) == 13 > 8 and {w.width for w in short} == {192}
    assert {w.width for w in admitted if len(w.prompt) == 900} == {1280}


def test_the_hard_line_preempts_the_newest_rows_and_shrinks_only_their_pool():
    p = BudgetPolicy(sheet(slots_mb=40, hard=0.802), prefill_tokens=100_000)
    p.offer(mixed())
    run_pass(p, live=0)
    newest = list(p.running)[-3:]                           # short rows: the long pool filled first
    preempt, _ = run_pass(p, live=802 * MB)                 # 2 MiB over the guard line: three short slots
    assert preempt == newest[::-1] and pools(p) == {192: 10, 1280: 6}
    assert run_pass(p, live=700 * MB, preempted=preempt) == ([], [])   # both pools are full
    p.finished([0])                                          # a short row leaves: the pool does not grow back
    assert [w for w in p.admit()][0].width == 192 and pools(p) == {192: 10, 1280: 6}


def test_a_class_that_arrives_later_gets_its_share_as_the_pools_running_shrink_to_theirs():
    p = BudgetPolicy(sheet(slots_mb=40), prefill_tokens=100_000)
    p.offer(mixed(n_short=60, n_long=0))
    assert len(p.admit()) == 53 and pools(p) == {192: 53}    # alone, the short class takes the budget
    p.offer(mixed(n_short=0, n_long=20, start=100))
    assert p.admit() == []                                   # no KV free yet; short rows stop refilling
    p.finished(list(range(43)))
    admitted = p.admit()
    assert {w.width for w in admitted} == {1280} and p.reserved() <= p.sheet.kv_budget
    assert pools(p)[192] == 10 and pools(p)[1280] == 6         # its share is 7; 32.5 MiB free fits 6


def test_the_pools_never_exceed_the_kv_budget_and_every_row_runs_in_a_pool_as_wide():
    rnd = random.Random(3)
    p = BudgetPolicy(sheet(slots_mb=30), max_rows=24, prefill_tokens=3000)
    lengths = [rnd.choice([20, 45, 300, 420, 700, 900, 1500]) for _ in range(300)]
    p.offer([Waiting(i, np.zeros(n, np.int32), rnd.randint(1, 128)) for i, n in enumerate(lengths)])
    done = 0
    while p.queue or p.running:
        p.admit()
        assert p.reserved() <= p.sheet.kv_budget and sum(s for s, _ in p.shapes()) <= 24
        widths = pools(p)
        for w in p.running.values():   # in its class's pool, or a wider one's borrowed slot
            assert w.full_length <= w.width and w.width in widths and w.pool in p.pools
            assert width_class(w.full_length) == width_class(w.width) or w.width > w.full_length
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
    kv = sum(n * w * MB // 256 for n, w in p.shapes())
    copy = sum(n for n, _ in p.shapes()) * 5 * MB // 4
    assert len(p.shapes()) == 2 and p.reserved() == kv + copy <= s.kv_budget < kv + copy + s.slot(192, 1280)


def test_a_class_is_the_length_rounded_to_an_eighth_of_its_doubling_and_never_finer_than_16():
    # step = max(16, P // 8), P the power of two at or above the length
    assert [width_class(n) for n in (1, 16, 17, 64 + 16, 64 + 32, 45 + 128)] == [16, 16, 32, 80, 96, 192]
    assert [width_class(n) for n in (129, 300, 513, 420 + 128, 1025, 900 + 128)] == [160, 320, 640, 640, 1280, 1280]
    assert [width_class(n) for n in (2048, 2049, 4096, 4097)] == [2048, 2560, 4096, 5120]   # as before


def test_rows_of_a_short_prompt_and_few_new_tokens_reserve_their_length_not_the_next_64():
    """A 64 + 16-token row held a slot of 128 tokens, which capped the H200 peers run at 66 rows where ~100 fit."""
    p = BudgetPolicy(sheet(slots_mb=40), prefill_tokens=100_000)   # 40 slots of 256 tokens
    p.offer([Waiting(i, np.zeros(64, np.int32), 16) for i in range(200)])   # 80 tokens: class 80
    assert len(p.admit()) == 128 and pools(p) == {80: 128} and p.reserved() == 40 * MB


def test_a_full_pool_grows_into_the_kv_a_drained_class_leaves_with_only_a_layer_copied_twice():
    """The 1280 pool copied whole needed its old and new slots free at once, so it stayed at 9 slots
    while the short class drained and 14 MiB of the budget sat idle: the three-tier job's tail."""
    p = BudgetPolicy(sheet(slots_mb=60, layers=32), prefill_tokens=100_000)
    p.offer(mixed(n_short=40, n_long=40))
    p.admit()
    assert pools(p) == {192: 15, 1280: 9}
    slot = p.sheet.slot(1280, 1280)                      # 5 MiB + 1280 tokens of one layer's copy
    while short := [r for r, w in p.running.items() if len(w.prompt) == 45]:
        p.finished(short)
        before = pools(p)[1280]
        p.admit()
        copy = before * slot // 32 if pools(p)[1280] > before else 0   # the old pool's layer, held twice
        assert p.reserved() + copy <= p.sheet.kv_budget
    assert pools(p) == {1280: 11} and p.sheet.kv_budget - p.reserved() < slot


def test_a_full_class_borrows_the_free_slots_of_a_wider_pool_whose_class_waits_for_none():
    """The short class's last rows waited for their own pool's slots while the long pool, its class
    drained of waiting rows, ran with slots free: the tail of a small job."""
    p = BudgetPolicy(sheet(slots_mb=40), prefill_tokens=100_000)
    p.offer(mixed(n_short=30, n_long=4))
    p.admit()
    assert pools(p) == {192: 26, 1280: 4} and len(p.queue) == 4           # every long row runs; 4 short wait
    longs = [r for r, w in p.running.items() if len(w.prompt) == 900]
    p.finished(longs[:3])                                                 # three long slots free, one long row runs
    borrowed = p.admit()
    assert [w.width for w in borrowed] == [1280] * 3 and {len(w.prompt) for w in borrowed} == {45}
    assert pools(p) == {192: 26, 1280: 4} and p.reserved() <= p.sheet.kv_budget
    p.finished([longs[3], borrowed[0].row])        # the pool now holds only borrowers: it lends no more
    assert p.admit() == [] and pools(p) == {192: 26, 1280: 4}
    p.finished([w.row for w in borrowed[1:]])      # drained, its KV goes to the short class
    assert {w.width for w in p.admit()} == {192} and 1280 not in pools(p)
