"""Resident mode: every layer kept after its first read, through the same loop as streaming."""

import pytest

from spill.streamer.core import Row, Streamer

PROMPTS = [[5, 9, 13, 2, 7], [30, 31], list(range(40, 90)), [3] * 17]
JOINS = {0: [0, 1], 2: [2], 5: [3]}   # pass -> rows that join before it


def _drive(streamer):
    """({row: tokens}, [(bytes_streamed, reader_memory) of each pass])."""
    out, reports, passes = {}, [], 0
    while passes <= max(JOINS) or not streamer.idle:
        for k in JOINS.get(passes, []):
            streamer.add(Row(f"r{k}", PROMPTS[k], 8))
        r = streamer.step()
        reports.append((r.bytes_streamed, r.reader_memory))
        for e in r.emitted:
            out.setdefault(e.row_id, []).append(e.token)
        passes += 1
    streamer.close()
    return out, reports


@pytest.mark.parametrize("family,bits,in_flight", [("llama", None, "2"), ("llama", None, "1"), ("gemma2", None, "2"),
                                                   ("qwen3", 4, "1")])
def test_resident_output_is_the_streamed_output_and_only_the_first_pass_reads(make_tiny, monkeypatch, family, bits,
                                                                              in_flight):
    folder = make_tiny(family, bits=bits)
    monkeypatch.setenv("SPILL_LAYERS_IN_FLIGHT", in_flight)   # streamed with one layer alive or two
    streamed, s_reports = _drive(Streamer(folder, prefill_chunk=16))
    engine = Streamer(folder, prefill_chunk=16, resident=True)
    total = engine.plan.streamed_bytes
    resident, r_reports = _drive(engine)
    assert resident == streamed and len(resident) == len(PROMPTS)
    assert all(b == total for b, _ in s_reports)
    assert [b for b, _ in r_reports] == [total] + [0] * (len(r_reports) - 1)
    assert all(mem == 0 for _, mem in r_reports)   # the reader's buffers are freed once every layer is kept


@pytest.mark.parametrize("in_flight", ["1", "2"])
def test_switching_mode_between_jobs_keeps_then_streams_again(make_tiny, monkeypatch, in_flight):
    """With one layer in flight (a CUDA GPU's) the reader copies a layer once the one before is released, which
    kept layers never are: then once it is asked for (no hang), and resident, two ahead again."""
    monkeypatch.setenv("SPILL_LAYERS_IN_FLIGHT", in_flight)
    engine = Streamer(make_tiny("llama"), prefill_chunk=16)
    total = engine.plan.streamed_bytes

    def two_passes():
        engine.add(Row("a", PROMPTS[0], 2))
        first, second = engine.step(), engine.step()
        engine.clear()
        return first.bytes_streamed, second.bytes_streamed
    assert two_passes() == (total, total)
    engine.set_resident(True)
    assert two_passes() == (total, 0)
    assert two_passes() == (0, 0)
    engine.set_resident(False)
    assert two_passes() == (total, total)
    engine.close()
