"""`spill check --speculate`: free-running rows carrying prompt-lookup drafts give mlx-lm's greedy tokens on every
family the factory makes, and its quantized cache's over quantized KV, with drafts accepted; in float32 a row that is
not identical fails the check."""

import mlx.core as mx
import numpy as np
import pytest
from rich.console import Console

from spill.coordinator.report import print_check
from spill.factory.families import FAMILIES
from spill.streamer.check import CheckReport, CheckRow, run_check

cpu_default = pytest.mark.skipif(mx.default_device() == mx.gpu, reason="written for the CPU's float32 default")


@cpu_default
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rows_with_drafts_are_identical_to_the_resident_on_every_family(make_tiny, family, capsys):
    report = run_check(make_tiny(family), n=4, max_tokens=16, prefill_chunk=16, speculate=4)
    assert report.gates_identity and report.passed, [(r.id, r.first_difference()) for r in report.failures()]
    assert report.identical == 4 and all(len(r.got) == 16 for r in report.rows)
    assert report.drafted > report.accepted > 0 and report.tokens_per_pass > 1
    assert all(r.forced_steps == len(r.ref_logits) for r in report.rows)   # teacher-forced: a token a pass
    print_check(report, Console(width=200))
    assert (f"drafts: up to 4 a pass by prompt lookup on the free-running rows, {report.drafted} proposed, "
            f"{report.accepted} accepted, {report.tokens_per_pass:.2f} tokens a pass; identity gated"
            in capsys.readouterr().out.splitlines())


def _report(dtype: str, speculate: int, kv_bits: int | None = None, margin: float = 0.0) -> CheckReport:
    """One row whose teacher-forced logits agree and whose free-running tokens differ from the resident's at its
    third token, where the resident's top two logits are `margin` apart."""
    logits = [np.zeros(4), np.zeros(4), np.array([0.0, 0.0, 0.0, margin])]
    row = CheckRow("0", 5, 0, [1, 2, 3], logits, got=[1, 2, 4], forced_steps=3, agree=3)
    return CheckReport([row], dtype, "cpu", 1e-7, 1.0, 1e-5, True, kv_bits=kv_bits, speculate=speculate)


def test_over_quantized_kv_a_row_that_parts_at_a_near_tie_passes_and_says_so(capsys):
    """A K or V value a chunk of drafts computes a rounding apart can round to the next quantized level: where the
    resident's top two logits nearly tie, either token is the model's (docs/benchmarks.md)."""
    assert _report("float32", 4, kv_bits=8, margin=1e-5).passed
    assert not _report("float32", 4, kv_bits=8, margin=1.0).passed   # a clear argmax: drafts changed a token
    assert not _report("float32", 4, margin=1e-5).passed             # unquantized: drafts change nothing at all
    assert print_check(_report("float32", 4, kv_bits=8, margin=1e-5), Console(width=200))
    assert "row 0 free-running diverges at token 2 (a near-tie over quantized KV): resident [3] streamed [4]" \
        in capsys.readouterr().out.splitlines()


def test_a_row_drafts_changed_fails_in_float32_and_is_reported_elsewhere(capsys):
    assert _report("float32", 0).passed and _report("bfloat16", 4).passed   # no drafts, or a flat bf16 argmax
    assert not print_check(_report("float32", 4), Console(width=200))
    out = capsys.readouterr().out.splitlines()
    assert "row 0 fails: teacher-forced agrees, free-running with drafts is not identical; max logit difference " \
           "0.00e+00" in out
    assert "row 0 free-running diverges at token 2: resident [3] streamed [4]" in out and out[-1].startswith("FAILED")


@cpu_default
@pytest.mark.parametrize("bits", [8, 4])
def test_rows_with_drafts_over_quantized_kv_are_identical_to_mlx_lms_quantized_cache(make_tiny, bits):
    report = run_check(make_tiny("llama"), n=4, max_tokens=16, prefill_chunk=16, kv_bits=bits, kv_group_size=32,
                       speculate=4)
    assert report.gates_identity and report.passed, [(r.id, r.first_difference()) for r in report.failures()]
    assert report.identical == 4 and report.drafted > report.accepted > 0 and report.tokens_per_pass > 1
