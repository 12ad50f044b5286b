"""`spill check` on model folders the project did not generate (see tests/data/NOTICE.md)."""

import pytest

from spill.streamer.check import run_check

from . import foreign


def _assert_identical(rows):
    assert [r.got for r in rows] == [r.expected for r in rows]
    assert sum(len(r.got) for r in rows) > 0
    assert max(r.max_logit_diff for r in rows) <= 1e-4


@pytest.mark.parametrize("build", ["mistral_v03", "llama32_with_phi3_tokenizer"])
def test_check_passes_on_foreign_folders(tmp_path, build):
    folder = getattr(foreign, build)(tmp_path / "m")
    _assert_identical(run_check(folder, n=6, max_tokens=6, prefill_chunk=32).rows)


def test_check_passes_on_qwen25_config_and_template(tmp_path, make_tiny):
    folder = foreign.qwen25(tmp_path / "m", make_tiny("qwen2"))
    _assert_identical(run_check(folder, n=6, max_tokens=6, prefill_chunk=32).rows)
