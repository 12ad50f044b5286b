"""The reader's "pinned" path (a CUDA GPU's default): its buffers page-locked, each tensor copied by the GPU's
copy engine to a 256-byte boundary of MLX memory (gpu_copy.py); with the host doing the engine's part, and on a
CUDA GPU with the real one."""

import sys

import mlx.core as mx
import numpy as np
import pytest

from ._reader_util import HostCopy, address, check_layer
from ._safetensors_util import make_model

from spill.streamer import gpu_copy
from spill.streamer import reader as reader_mod
from spill.streamer.plan import load_plan
from spill.streamer.reader import WeightReader


def test_each_tensor_is_placed_at_256_bytes_in_order():
    class T:
        def __init__(self, nbytes):
            self.nbytes = nbytes
    a, b, c = T(10), T(512), T(3)
    assert [(spec, pos, at) for spec, pos, at in gpu_copy.placed([(a, 6), (b, 16), (c, 530)])] == [
        (a, 6, 0), (b, 16, 256), (c, 530, 768)]


@pytest.mark.parametrize("driver", [True, False])
def test_on_a_cuda_gpu_the_reader_reads_into_pinned_buffers_the_gpu_copies_out(tmp_path, monkeypatch, driver, on_device):
    """O_DIRECT into MLX's CUDA (managed) memory left weights wrong now and then, and a host copy out of the
    reader's buffers cost a pass 1.35x its read (platform.read_into). Without a CUDA driver: its own buffers."""
    on_device("gpu-NVIDIA H200")   # as the supervisor hands it to its actors there
    monkeypatch.delenv("SPILL_READ_INTO", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    engine = HostCopy()
    monkeypatch.setattr(reader_mod.gpu_copy, "engine", lambda: engine if driver else None)
    tensors = make_model(tmp_path, layers=2)
    with WeightReader(load_plan(tmp_path)) as reader:   # the stored dtype: bytes compared as they are
        assert reader.into == ("pinned" if driver else "buffers") and reader.buffer_bytes > 0
        assert len(engine.pinned) == (len(reader._bufs) if driver else 0)
        reader.start_pass()
        got = [reader.take(i) for i in range(2)][1]
    tensors_read = sum(len(layer) for layer in load_plan(tmp_path).layers)
    assert engine.copies == (tensors_read if driver else 0) and not engine.pinned   # one a tensor; unpinned at close
    name = "model.layers.1.self_attn.q_proj.weight"
    a = got[name]
    assert np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes() == tensors[name][1].tobytes()


def test_buffers_the_driver_will_not_pin_are_copied_out_by_the_host(tmp_path, monkeypatch):
    """Page-locked memory is the machine's to give: where the driver refuses a buffer, none stays pinned and the
    reader copies out on the host, as with SPILL_READ_INTO=buffers, rather than failing the streamer."""
    monkeypatch.setenv("SPILL_READ_SLOTS", "2")
    engine = HostCopy()
    pin = engine.pin
    def pin_one_only(buf):
        if engine.pinned:
            raise RuntimeError("CUDA cuMemHostRegister_v2 failed: out of memory")
        pin(buf)
    engine.pin = pin_one_only
    tensors = make_model(tmp_path, layers=2)
    plan = load_plan(tmp_path)
    with WeightReader(plan, into="pinned", engine=engine) as reader:
        assert reader.into == "buffers" and not engine.pinned
        reader.start_pass()
        for i in range(2):
            check_layer(reader.take(i), tensors, [t.name for t in plan.layers[i]])
    assert engine.copies == 0


def test_pinned_tensors_are_views_at_256_bytes_where_the_file_s_are_not(tmp_path, monkeypatch):
    """A GPU's matmuls refuse a view not at 256 bytes, and a safetensors file places tensors at any even byte:
    copied out of the pinned buffers, each tensor is placed at 256 bytes (gpu_copy.placed) and viewed there."""
    tensors = make_model(tmp_path, layers=2, dtype="BF16")
    plan = load_plan(tmp_path)
    monkeypatch.setattr(reader_mod.mx, "default_device", lambda: mx.gpu)   # the reader's alignment on a GPU
    with WeightReader(plan, into="pinned", engine=HostCopy()) as reader:
        assert reader.tensors.align == 256
        assert any(pos % 256 for spec, pos in reader._layout[1][0])   # the file's positions: some off 256
        reader.start_pass()
        got = [reader.take(i) for i in range(2)][1]
        owner = reader._lent[1][0]
        base = address(owner)
        for spec, _, at in reader._placed[1]:
            assert at % 256 == 0 and address(got[spec.name]) == base + reader._lent[1][1] + at   # a view
        check_layer(got, tensors, [t.name for t in plan.layers[1]])


@pytest.mark.skipif(not (mx.is_available(mx.gpu) and sys.platform == "linux"), reason="no CUDA GPU here")
def test_on_a_cuda_gpu_the_copy_engine_delivers_the_file_s_bytes_pass_after_pass(tmp_path):
    """The real copy engine (gpu_copy.py, the CUDA driver): every tensor a view at 256 bytes, the stored bytes,
    over passes that copy into released layers' memory."""
    tensors = make_model(tmp_path, layers=3, dtype="BF16")
    plan = load_plan(tmp_path)
    with WeightReader(plan, into="pinned") as reader:
        assert reader.into == "pinned"
        for _ in range(3):
            reader.start_pass()
            for i in range(3):
                check_layer(reader.take(i), tensors, [t.name for t in plan.layers[i]])
                reader.release(i)
        assert reader.buffers_made <= 3
