"""Where drafts change a row's text over quantized KV: the two runs' records and their comparison."""

import numpy as np

from spill.streamer import check

from .scripts import load

kv_drafts = load("kv_drafts")
PROMPTS = {"a": [5, 9, 13, 5, 9, 13, 5, 9], "b": [7, 3, 11, 2]}


def test_the_first_difference_and_the_margin_of_a_decision():
    assert check.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert check.first_difference([1, 2, 3], [1, 4, 3]) == 1 and check.first_difference([1, 2], [1, 2, 3]) == 2
    assert kv_drafts.margin(np.array([0.5, 2.0, 1.75])) == (1, 0.25)


def test_codes_are_one_a_value_and_move_a_level_where_a_value_crosses_a_boundary():
    x = np.linspace(-1.0, 1.0, 64, dtype=np.float32)
    for bits in (8, 4):
        c = kv_drafts.codes(x, bits, 32).reshape(-1)
        assert c.size == 64 and c.max() == 2 ** bits - 1 and (np.diff(c[:32].astype(np.int64)) >= 0).all()
    assert (kv_drafts.codes(x, 8, 32) == kv_drafts.codes(x + 1e-9, 8, 32)).all()


def test_runs_with_and_without_drafts_over_8_bit_kv_store_what_they_computed(make_tiny):
    folder = make_tiny("llama", "float32")
    runs = [kv_drafts.record(folder, PROMPTS, dict.fromkeys(PROMPTS, 24), [], k, 8, 32) for k in (0, 4)]
    assert all(r.checked > 0 and r.stale == 0 for r in runs)
    for rid in PROMPTS:
        row = kv_drafts.compare_row(*runs, rid, 8, 32)
        assert row["tokens"] == [24, 24] and row["codes_differing"][1] > 0
        assert row["first_difference"] is None or "margins" in row
