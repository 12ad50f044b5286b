"""The draft model's price (--draft): fitted from timed drafting passes, timed here once by running the streamer's
own DraftModel, and again where a job's batch is wider than any it was timed at."""

import pytest

from spill.admission import drafter
from spill.admission.drafter import DraftCost


def test_the_price_is_fitted_from_timed_passes_and_nothing_drafting_costs_nothing():
    true = DraftCost(base_s=0.02, base_row_s=0.001, step_s=0.05, step_row_s=0.01, prompt_token_s=0.003)
    timings = [[n, k, true.seconds(n, k)] for n in (1, 16) for k in (1, 4)]
    fitted = drafter.fit(timings, 0.003)
    for n, k, new in ((8, 3, 0), (64, 8, 200)):
        assert fitted.seconds(n, k, new) == pytest.approx(true.seconds(n, k, new))
    assert fitted.seconds(0, 4) == fitted.seconds(16, 0) == 0.0
    assert drafter.fit([[1, 1, 0.5], [16, 1, 0.2], [1, 4, 0.5], [16, 4, 0.2]]).step_row_s == 0.0   # never below 0


def test_a_draft_model_is_timed_here_once_and_again_at_a_wider_batch(make_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    folder = make_tiny("llama", "float32")
    timings, per_token = drafter.probe(folder, 16)
    assert [(n, k) for n, k, _ in timings] == [(16, 4), (16, 1), (1, 4), (1, 1)]
    assert all(t > 0 for *_, t in timings) and per_token >= 0.0
    assert drafter.open_drafter(tmp_path / "no-such-model", rows=4) is None   # the streamer says why it cannot load
    probed = []

    def probe(f, rows):
        probed.append(rows)
        return [[rows, 1, 0.1 * rows], [rows, 4, 0.4 * rows], [1, 1, 0.1], [1, 4, 0.4]], 0.01
    monkeypatch.setattr(drafter, "probe", probe)
    first = drafter.open_drafter(folder, rows=10)
    assert probed == [16] and drafter.stored_drafter(folder) == first and first.prompt_token_s == 0.01
    assert first.seconds(16, 4) == pytest.approx(6.4)
    drafter.open_drafter(folder, rows=18)                  # within WIDER of the widest timed: the stored price
    assert drafter.open_drafter(folder, rows=300, probe_it=False) == first and probed == [16]
    drafter.open_drafter(folder, rows=300)                 # a batch of 128: timed there too
    assert probed == [16, 128]
