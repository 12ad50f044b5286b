"""The projection's arithmetic on cases worked by hand."""

import importlib.util
from pathlib import Path

import pytest

from spill.admission.passmodel import PassShape
from spill.factory.presets import Shape
from spill.stages.model import idle_shares
from spill.stages.split import stage_shares

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("projection", ROOT / "benchmarks" / "projection.py")
projection = importlib.util.module_from_spec(spec)
spec.loader.exec_module(projection)


@pytest.fixture
def apple(on_device, monkeypatch):
    on_device("gpu-apple", 0)
    for name, value in (("SPILL_READ_SLOTS", "2"), ("SPILL_LAYERS_IN_FLIGHT", "2"), ("SPILL_READ_INTO", "mlx")):
        monkeypatch.setenv(name, value)


def test_the_70b_plan_has_llama_70b_bytes():
    plan = projection.model_plan()
    # a layer: q and o 8192 x 8192, k and v 8192 x 1024, gate, up and down 8192 x 28672, two norms; bf16
    layer = 2 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192)
    assert plan.layer_bytes(0) == layer == 1_711_308_800
    assert plan.streamed_bytes == 80 * layer
    assert plan.total_bytes == 80 * layer + 2 * (2 * 128256 * 8192 + 8192)   # embedding, head, final norm
    assert plan.kv_heads_and_dim == (8, 128)   # 80 layers x 2 x 8 x 128 x 2 bytes: 320 KiB of KV a token


def test_one_mac_is_the_single_mac_read_bound_job(apple):
    rows = projection.job_rows(150)
    plan = projection.model_plan()
    one = projection.project(1, projection.LINKS[0], rows, plan=plan)
    read = plan.streamed_bytes / projection.DISK   # 25.35 s: the layers at 5.4 GB/s, embedding and head resident
    assert one["mode"] == ["streamed"] and one["micro_batches"] == 1
    assert one["round_s"] == pytest.approx(read, abs=0.01)
    assert one["seconds"] == pytest.approx(one["passes"] * read, rel=1e-9)   # every pass read-bound, no fill
    assert one["idle"] == [0.0] and one["hop_ms"] == [0.0]


def test_a_pipeline_of_one_stage_prices_a_pass_as_its_pass_model():
    plan = projection.model_plan()
    model = projection.stage_model(plan)
    pipe = projection.Pipeline(projection.DISK, stages=[(model, plan.streamed_bytes, plan.total_bytes)],
                               reads=plan.streamed_bytes, hidden=8192, m=1)
    nbytes = plan.streamed_bytes
    for shape in (PassShape(64, 0, 64 * 500, nbytes), PassShape(200, 3000, 200 * 900, nbytes)):
        assert pipe.pass_s(shape) == pytest.approx(model.pass_s(shape))


def two_stages(stages, models, hop):
    """Two streamed stages, two micro-batches a round."""
    parts = [(s, p.streamed_bytes, p.total_bytes) for s, p in zip(models, stages)]
    return projection.Pipeline(projection.DISK, stages=parts,
                               reads=2 * stages[0].streamed_bytes, hop=hop, hidden=8192, m=2)


def test_equal_stages_with_as_many_micro_batches_and_a_fast_link_never_idle():
    plan = projection.model_plan()
    stages = projection.stage_plans(plan, 2)
    assert [len(p.layers) for p in stages] == [40, 40] and stages[0].streamed_bytes == stages[1].streamed_bytes
    models = [projection.stage_model(p) for p in stages]
    pipe = two_stages(stages, models, hop=(0.0, 1e18))
    shape = PassShape(100, 0, 100 * 500, pipe.reads)
    t, hops = pipe.times(shape)
    assert t[0] == t[1] == pytest.approx(40 * plan.layer_bytes(0) / projection.DISK)   # each reads its half
    assert idle_shares(t, hops, 2) == pytest.approx([0.0, 0.0])
    assert pipe.pass_s(shape) == pytest.approx(plan.streamed_bytes / projection.DISK)   # a round: the whole read


def test_a_hop_carries_a_micro_batch_of_hidden_states_and_the_last_its_tokens():
    plan = projection.model_plan()
    stages = projection.stage_plans(plan, 2)
    models = [projection.stage_model(p) for p in stages]
    pipe = two_stages(stages, models, hop=(1e-4, 1.1e9))
    _, hops = pipe.times(PassShape(200, 0, 0, pipe.reads))
    # 100 rows a micro-batch: 100 x 8192 x 2 bytes over 10 GbE, then 100 x 4 bytes of tokens back
    assert hops == pytest.approx([1e-4 + 100 * 8192 * 2 / 1.1e9, 1e-4 + 100 * 4 / 1.1e9])


def test_stages_that_fit_resident_are_split_by_compute_as_the_advisor_splits_them(apple):
    """A 1B-like llama with a 128k vocabulary (its head weighs 4 layers): two Macs hold it resident, the head's
    stage with fewer layers; the 70B streams, split by bytes."""
    plan = projection.model_plan(Shape(hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8, head_dim=64,
                                       vocab=128256))
    rows = projection.job_rows(60)
    small = projection.project(2, projection.LINKS[0], rows, plan=plan)
    assert small["mode"] == ["resident"] * 2 and small["split"] == "compute"
    assert small["layers"] == [len(s.layers) for s in stage_shares(plan, 2, by_compute=True)] == [10, 6]
    big = projection.project(2, projection.LINKS[0], rows)
    assert big["mode"] == ["streamed"] * 2 and big["split"] == "bytes" and big["layers"] == [40, 40]
