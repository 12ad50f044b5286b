"""The quantized-KV quality comparison: token agreement with the unquantized output, per kind."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("kv_quality", ROOT / "benchmarks" / "kv_quality.py")
kv_quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv_quality)


def test_agreement_counts_the_prefix_and_the_equal_positions():
    assert kv_quality.agreement([1, 2, 3, 4], [1, 2, 3, 4], 16) == (1.0, 1.0)
    assert kv_quality.agreement([1, 2, 3, 4], [1, 2, 9, 4], 16) == (0.5, 0.75)
    assert kv_quality.agreement([1, 2, 3, 4], [1, 2, 9, 4], 2) == (1.0, 1.0)   # the first 2 tokens agree


def test_an_output_that_runs_on_past_the_unquantized_stop_differs_there():
    assert kv_quality.agreement([1, 2], [1, 2, 3, 4], None) == (0.5, 0.5)
    assert kv_quality.agreement([1, 2], [1, 2, 3, 4], 16) == (0.5, 0.5)
    assert kv_quality.agreement([], [], 16) == (1.0, 1.0)


def test_summary_per_kind_and_overall():
    base = {"open-1": "a b c d", "edit-1": "x y"}
    other = {"open-1": "a b z d", "edit-1": "x y"}
    fig = kv_quality.summarize(base, other, str.split, [2, None])
    assert fig["edit"] == {"rows": 1, "unchanged": 1.0, "prefix_2": 1.0, "equal_2": 1.0,
                           "prefix_all": 1.0, "equal_all": 1.0}
    assert fig["open"]["unchanged"] == 0.0 and fig["open"]["prefix_all"] == 0.5 and fig["open"]["equal_all"] == 0.75
    assert fig["all"]["rows"] == 2 and fig["all"]["unchanged"] == 0.5


def test_formats_named_in_words():
    assert kv_quality.label("none#2") == "unquantized, again"
    assert kv_quality.label("8/64") == "8-bit, group 64"
    assert kv_quality.label("q8_0") == "q8_0" and kv_quality.label("f16#2") == "f16, again"


def test_summary_of_token_ids():
    fig = kv_quality.summarize({"edit-1": [1, 2, 3]}, {"edit-1": [1, 2, 4]}, list, [None])
    assert fig["all"]["unchanged"] == 0.0 and fig["all"]["prefix_all"] == 2 / 3
