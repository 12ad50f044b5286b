"""A resident pipeline's passes teach its stage model's price (`Calibration.stage_scale`), which the estimate uses."""

import pytest
import structlog

from spill import messages as m
from spill.admission.calibration import Calibration, Calibrator
from spill.admission.passmodel import PassModel, PassShape
from spill.stages.model import pass_seconds

MODEL = PassModel(bandwidth=2e9, fixed_s=0.05, per_row_s=0.01)


def report(seconds: float, bytes_streamed: int = 0, rounds: int = 8) -> m.Pass:
    return m.Pass(0, 1, seconds=seconds, wait_s=0.0, compute_s=seconds, decode_rows=6, prefill_tokens=0, emitted=6,
                  finished=[], active_memory=0, peak_memory=0, bytes_streamed=bytes_streamed, rounds=rounds)


def test_a_resident_pipelines_passes_are_kept_as_their_seconds_over_the_stage_models_price(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    hook = Calibrator(structlog.get_logger())
    hook.cal = Calibration("a|float32|cpu|m1", MODEL)
    shape = PassShape(6, 0, 60, 0)
    priced = pass_seconds(MODEL, shape, 3, 3, 8)
    for took in (1.5, 2.0, 2.5):
        hook.observe_pipeline(shape, report(took * priced), 3, 3)
    hook.observe_pipeline(shape, report(9 * priced, bytes_streamed=1 << 20), 3, 3)   # the pass that read the layers
    back = Calibration.load("a|float32|cpu|m1")
    assert back.stage_scale(3) == pytest.approx(2.0) and back.stage_scale(2) == 1.0
    assert back.seen == 0 and back.model == MODEL   # no refit of the one-process pass model


def test_the_estimate_prices_a_pipelines_passes_that_read_nothing_at_their_measured_scale():
    from tests.admission.test_simulate import BYTES, FifoPolicy, waiting
    from spill.admission.simulate import SimRow, simulate
    rows = [SimRow(i, 40, 10 + i % 7) for i in range(24)]
    plain = simulate(rows, FifoPolicy(), waiting, MODEL, 0, read_once=BYTES, stages=3)
    scaled = simulate(rows, FifoPolicy(), waiting, MODEL, 0, read_once=BYTES, stages=3, stage_scale=2.0)
    first = plain.timeline[0][0]   # the pass that reads every layer once: priced as before
    assert scaled.passes == plain.passes and scaled.timeline[0][0] == pytest.approx(first)
    assert scaled.total_seconds - first == pytest.approx(2 * (plain.total_seconds - first))


def test_replicas_passes_are_kept_apart_from_a_pipelines_and_price_one_replicas_share_of_each_pass(tmp_path, monkeypatch):
    from tests.admission.test_simulate import BYTES, FifoPolicy, waiting
    from spill.admission.simulate import SimRow, simulate
    from spill.stages.model import replica_seconds
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    hook = Calibrator(structlog.get_logger())
    hook.cal = Calibration("a|float32|cpu|m1", MODEL)
    shape = PassShape(6, 0, 60, 0)
    hook.observe_pipeline(shape, report(1.5 * replica_seconds(MODEL, shape, 3), rounds=1), 3, 1, replicas=True)
    back = Calibration.load("a|float32|cpu|m1")
    assert back.stage_scale(3, replicas=True) == pytest.approx(1.5) and back.stage_scale(3) == 1.0
    rows = [SimRow(i, 40, 10 + i % 7) for i in range(24)]
    one = simulate(rows, FifoPolicy(), waiting, MODEL, 0, read_once=BYTES)
    three = simulate(rows, FifoPolicy(), waiting, MODEL, 0, read_once=BYTES, stages=3, replicas=True)
    assert three.passes == one.passes and three.total_seconds < one.total_seconds   # no rounds: a token a row a pass
    scaled = simulate(rows, FifoPolicy(), waiting, MODEL, 0, read_once=BYTES, stages=3, replicas=True, stage_scale=2.0)
    first = three.timeline[0][0]
    assert scaled.total_seconds - first == pytest.approx(2 * (three.total_seconds - first))


def test_a_pipelines_hops_are_priced_alike_in_its_measured_scale_and_in_the_estimate(tmp_path, monkeypatch):
    from tests.admission.test_simulate import BYTES, FifoPolicy, waiting
    from spill.admission.simulate import SimRow, simulate
    from spill.stages.model import hop_price
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    hop = hop_price([[8e9, 0.5, 0.002, 1e5]], 4096)   # a slow link: 2 ms and 100 kB/s; 4 KiB a token's hidden states
    hook = Calibrator(structlog.get_logger())
    hook.cal = Calibration("a|float32|cpu|m1", MODEL)
    shape = PassShape(6, 0, 60, 0)
    assert pass_seconds(MODEL, shape, 3, 3, 8, hop) > 8 * 3 * hop(2) > pass_seconds(MODEL, shape, 3, 3, 8)   # it paces
    hook.hop = hop
    hook.observe_pipeline(shape, report(pass_seconds(MODEL, shape, 3, 3, 8, hop)), 3, 3)
    assert Calibration.load("a|float32|cpu|m1").stage_scale(3) == pytest.approx(1.0)   # the link's time is priced
    rows = [SimRow(i, 40, 10 + i % 7) for i in range(24)]
    free = simulate(rows, FifoPolicy(), waiting, MODEL, 0, read_once=BYTES, stages=3)
    slow = simulate(rows, FifoPolicy(), waiting, MODEL, 0, read_once=BYTES, stages=3, hop=hop)
    assert slow.passes == free.passes and slow.total_seconds > free.total_seconds + free.passes * 0.002
