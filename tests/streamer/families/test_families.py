"""`spill check` identity and first-token agreement on generated models of the newer families."""

import pytest
from rich.console import Console

from spill.coordinator.report import print_check
from spill.streamer.check import run_check


# gemma2's tiny preset has 2 KV heads for 4 query heads (grouped attention, the batch-mask case);
# gemma3_text's has a 32-token window on every other layer, which the check's prompts cross
@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma2", "gemma3_text"])
def test_streamed_equals_resident_and_first_tokens_match_generate(make_tiny, family):
    report = run_check(make_tiny(family), n=6, max_tokens=6, prefill_chunk=32)
    rows = report.rows
    assert report.passed and report.max_logit_diff <= 1e-4
    assert [r.got for r in rows] == [r.expected for r in rows]
    assert sum(len(r.got) for r in rows) > 0
    assert [r.first_got for r in rows] == [r.first_expected for r in rows]
    assert None not in [r.first_got for r in rows]


def test_the_check_counts_first_tokens_apart(make_tiny, capsys):
    report = run_check(make_tiny("llama"), n=3, max_tokens=3, prefill_chunk=32)
    report.rows[1].first_expected = -1   # as if mlx_lm.generate had started row 1 otherwise
    print_check(report, Console(width=200))
    assert capsys.readouterr().out.rstrip().splitlines()[-2] == "identity 3/3, first-token 2/3"
