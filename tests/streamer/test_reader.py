import os
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from ._reader_util import HostCopy, address, check_layer
from ._safetensors_util import cached_pages, drop_from_cache, make_model, model_tensors

from spill.errors import SpillError
from spill.streamer.plan import load_plan
from spill.streamer import mlx_buffers, pages
from spill.streamer import reader as reader_mod
from spill.streamer.reader import WeightReader

@pytest.fixture(params=["BF16", "F16", "F32"])
def model(request, tmp_path):
    tensors = make_model(tmp_path, shards=2, layers=4, dtype=request.param)
    return load_plan(tmp_path), tensors


@pytest.mark.parametrize("into", ["mlx", "buffers", "pinned"])
@pytest.mark.parametrize("read_ahead", [True, False])
def test_layers_and_resident_are_the_file_bytes(model, read_ahead, into):
    plan, tensors = model
    with WeightReader(plan, read_ahead=read_ahead, into=into, engine=HostCopy()) as reader:
        res = reader.read_resident()
        check_layer(res, tensors, [t.name for t in plan.resident])
        for _ in range(3):
            reader.start_pass()
            for i, layer in enumerate(plan.layers):
                check_layer(reader.take(i), tensors, [t.name for t in layer])
        stats = reader.stats()
    assert stats["bytes_read"] == 3 * plan.streamed_bytes + sum(t.nbytes for t in plan.resident)
    assert stats["layers"] == 3 * len(plan.layers)
    assert stats["read_s"] > 0 and stats["wait_s"] > 0 and stats["convert_s"] > 0


@pytest.mark.parametrize("read_ahead", [True, False])
def test_cast_to_float32_is_exact(model, read_ahead):
    plan, tensors = model
    with WeightReader(plan, dtype=mx.float32, read_ahead=read_ahead) as reader:
        check_layer(reader.read_resident(), tensors, [t.name for t in plan.resident], mx.float32)
        reader.start_pass()
        for i, layer in enumerate(plan.layers):
            check_layer(reader.take(i), tensors, [t.name for t in layer], mx.float32)


@pytest.mark.parametrize("direct,threads", [(False, 3), (True, 1), (True, 3)])
def test_threads_and_o_direct_give_the_same_bytes(model, direct, threads, monkeypatch):
    """Several read and convert threads, O_DIRECT with page-rounded reads around unaligned tensors,
    and tensors split into many chunks (the chunk shrunk to two pages)."""
    monkeypatch.setattr(reader_mod, "_CHUNK", 2 * pages.DIO)
    plan, tensors = model
    assert any(t.offset % pages.DIO for layer in plan.layers for t in layer)
    with WeightReader(plan, direct=direct, read_threads=threads, convert_threads=threads) as reader:
        assert reader.direct == (direct and sys.platform.startswith("linux"))
        check_layer(reader.read_resident(), tensors, [t.name for t in plan.resident])
        for dtype in (None, mx.float32):
            reader.tensors.dtype = dtype
            reader.start_pass()
            for i, layer in enumerate(plan.layers):
                check_layer(reader.take(i), tensors, [t.name for t in layer], dtype)
    assert reader.stats()["bytes_read"] == 2 * plan.streamed_bytes + sum(t.nbytes for t in plan.resident)


def test_o_direct_falls_back_to_plain_reads_where_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_mod, "open_direct", lambda paths: None)   # as on tmpfs or macOS
    tensors = make_model(tmp_path, layers=2)
    plan = load_plan(tmp_path)
    with WeightReader(plan, direct=True) as reader:
        assert not reader.direct
        reader.start_pass()
        check_layer(reader.take(0), tensors, [t.name for t in plan.layers[0]])


def _bytes_read_reaches(reader, want: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while reader.stats()["bytes_read"] < want and time.monotonic() < deadline:
        time.sleep(0.001)
    return reader.stats()["bytes_read"] >= want


def test_read_ahead_reads_the_next_layers_before_they_are_taken(tmp_path):
    tensors = make_model(tmp_path, layers=5)
    plan = load_plan(tmp_path)
    with WeightReader(plan) as reader:
        for order in ([0, 1, 2, 3, 4], [3, 4], [4, 2, 0], []):
            base = reader.stats()["bytes_read"]
            reader.start_pass(order)
            # both buffers fill before the first take(): the order's first two layers
            assert _bytes_read_reaches(reader, base + sum(plan.layer_bytes(i) for i in order[:2]))
            for k, i in enumerate(order):
                check_layer(reader.take(i), tensors, [t.name for t in plan.layers[i]])
                # and once a layer is taken, the one after the next is on its way
                assert _bytes_read_reaches(reader, base + sum(plan.layer_bytes(j) for j in order[:k + 3]))
            with pytest.raises(RuntimeError, match="no layer left in this pass"):
                reader.take(0)
            assert reader.stats()["bytes_read"] == base + sum(plan.layer_bytes(i) for i in order)


def test_serial_reads_only_inside_take(tmp_path):
    make_model(tmp_path, layers=3)
    plan = load_plan(tmp_path)
    with WeightReader(plan, read_ahead=False) as reader:
        reader.start_pass()
        time.sleep(0.05)
        assert reader.stats()["bytes_read"] == 0
        reader.take(0)
        assert reader.stats()["bytes_read"] == plan.layer_bytes(0)


def test_take_out_of_order_is_refused(tmp_path):
    make_model(tmp_path, layers=3)
    with WeightReader(load_plan(tmp_path)) as reader:
        with pytest.raises(RuntimeError, match="no layer left"):
            reader.take(0)
        reader.start_pass()
        with pytest.raises(RuntimeError, match=r"take\(1\): layers are taken in the pass's order, the next one is 0"):
            reader.take(1)
        with pytest.raises(ValueError, match=r"out of range 0-2"):
            reader.start_pass([0, 3])


def test_abandoned_pass_leaves_the_next_one_correct(tmp_path):
    tensors = make_model(tmp_path, layers=4)
    plan = load_plan(tmp_path)
    with WeightReader(plan) as reader:
        for _ in range(20):
            reader.start_pass()
            reader.take(0)
            reader.start_pass([2, 3])          # abandons layers 1-3 of the first pass
            for i in (2, 3):
                check_layer(reader.take(i), tensors, [t.name for t in plan.layers[i]])


def test_file_truncated_after_the_plan_is_a_spill_error(tmp_path):
    make_model(tmp_path, layers=3, index=False)
    plan = load_plan(tmp_path)
    path = tmp_path / "model.safetensors"
    spec = plan.layers[2][1]
    with open(path, "r+b") as f:
        f.truncate(spec.offset + 4)
    for read_ahead in (True, False):
        with WeightReader(plan, read_ahead=read_ahead) as reader:
            reader.start_pass()
            reader.take(0)
            reader.take(1)
            with pytest.raises(SpillError) as info:
                reader.take(2)
            assert str(info.value) == (
                f"{path}: expected {spec.name} at bytes {spec.offset}-{spec.offset + spec.nbytes}, found the "
                f"file ending at byte {spec.offset + 4}; it changed after the plan was made, re-download it")


def test_close_stops_the_threads(tmp_path):
    make_model(tmp_path, layers=3)
    before = threading.active_count()
    reader = WeightReader(load_plan(tmp_path))
    reader.start_pass()
    reader.take(0)
    reader.close()
    reader.close()
    assert threading.active_count() == before


@pytest.mark.parametrize("cores, slots, expected", [(2, "", 1), (16, "", 2), (2, "2", 2)])
def test_buffers_are_reused_not_reallocated(tmp_path, monkeypatch, cores, slots, expected):
    """Two read-ahead buffers, one on a CPU of fewer than 8 cores (platform.read_slots); SPILL_READ_SLOTS sets it."""
    from spill import platform
    monkeypatch.setattr(platform.os, "cpu_count", lambda: cores)
    monkeypatch.setenv("SPILL_READ_SLOTS", slots)
    make_model(tmp_path, layers=3)
    plan = load_plan(tmp_path)
    with WeightReader(plan, into="buffers") as reader:
        bufs = [b.ctypes.data for b, _ in reader._bufs]
        assert all(a % (2 << 20) == 0 for a in bufs)   # huge-page aligned: large O_DIRECT requests
        def pages(layer):   # one file, tensors back to back: one span of whole pages
            start = min(t.offset for t in layer) // 4096 * 4096
            return -(-(max(t.offset + t.nbytes for t in layer) - start) // 4096) * 4096
        largest = max(pages(layer) for layer in plan.layers)
        assert reader.buffer_bytes == expected * largest
        for _ in range(3):
            reader.start_pass()
            for i in range(3):
                reader.take(i)
        assert [b.ctypes.data for b, _ in reader._bufs] == bufs


@pytest.mark.parametrize("read_ahead", [True, False])
def test_a_layer_stored_as_computed_is_views_of_the_memory_it_was_read_into(tmp_path, read_ahead):
    make_model(tmp_path, layers=3, dtype="BF16")
    plan = load_plan(tmp_path)
    with WeightReader(plan, read_ahead=read_ahead) as reader:
        assert reader.buffer_bytes == 0          # no buffers of its own: what it reads is MLX memory
        reader.start_pass()
        for i in range(3):
            got = reader.take(i)
            # tensors whose bytes sit at a multiple of their item size (the factory packs others unaligned)
            placed = [(spec, pos) for spec, pos in reader._layout[i][0] if pos % got[spec.name].itemsize == 0]
            base = address(got[placed[0][0].name]) - placed[0][1]
            assert len(placed) > 1 or i == 1
            assert all(address(got[spec.name]) - pos == base for spec, pos in placed)   # one read, no copies


def test_a_tensor_whose_bytes_are_misaligned_is_copied_whole(tmp_path):
    from ._safetensors_util import write_safetensors
    odd = np.arange(3, dtype=np.uint8)
    f32 = np.arange(6, dtype=np.float32).reshape(2, 3)
    write_safetensors(tmp_path / "model.safetensors", {
        "model.layers.0.a.weight": ("U8", odd), "model.layers.0.b.weight": ("F32", f32)})
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 1}')
    plan = load_plan(tmp_path)
    with WeightReader(plan) as reader:
        reader.start_pass()
        got = reader.take(0)
    assert np.array(got["model.layers.0.b.weight"]).tolist() == f32.tolist()
    assert np.array(got["model.layers.0.a.weight"]).tolist() == odd.tolist()


@pytest.mark.parametrize("read_ahead", [True, False])
@pytest.mark.parametrize("code, dtype", [("F32", None), ("BF16", None), ("BF16", mx.float32)])
@pytest.mark.parametrize("into", ["mlx", "pinned"])
def test_a_released_layer_s_memory_takes_a_later_layer_without_a_new_buffer(tmp_path, monkeypatch, read_ahead,
                                                                            code, dtype, into):
    """A new MLX buffer is zero-filled (a 59 MB one: 4 ms from MLX's cache, 41 ms fresh, on 2 vCPUs): over four
    passes every layer is read into a released layer's memory, none new beyond the pipeline's own (the slot's,
    the ready and the computing layer's). A layer computes for 20 ms, so the ready one is converted meanwhile:
    how many the first pass needs was a race when compute took no time (CI saw 2, then 3)."""
    tensors = make_model(tmp_path, layers=5, dtype=code)
    plan = load_plan(tmp_path)
    made, zeros = [], mx.zeros
    monkeypatch.setattr(mlx_buffers.mx, "zeros", lambda *a, **k: made.append(a) or zeros(*a, **k))
    with WeightReader(plan, dtype=dtype, read_ahead=read_ahead, into=into, engine=HostCopy()) as reader:
        for n in range(4):
            reader.start_pass()
            for i in range(5):
                check_layer(reader.take(i), tensors, [t.name for t in plan.layers[i]], dtype)
                time.sleep(0.02)
                reader.release(i)
        assert 1 <= len(made) <= len(reader._bufs) + 2 < 20


@pytest.mark.parametrize("in_flight, made", [(1, 1), (2, 2)])
def test_with_one_layer_in_flight_the_next_is_copied_only_once_the_computing_one_is_released(tmp_path, monkeypatch,
                                                                                           in_flight, made):
    """A CUDA GPU's reader (pinned, one layer in flight): the next layer is not copied into MLX memory while the
    one computing holds it, so every layer of every pass is copied into the same buffer, where two take two."""
    tensors = make_model(tmp_path, layers=5)
    plan = load_plan(tmp_path)
    buffers, zeros = [], mx.zeros
    monkeypatch.setattr(mlx_buffers.mx, "zeros", lambda *a, **k: buffers.append(a) or zeros(*a, **k))
    with WeightReader(plan, into="pinned", engine=HostCopy(), in_flight=in_flight) as reader:
        for _ in range(3):
            reader.start_pass()
            for i in range(5):
                check_layer(reader.take(i), tensors, [t.name for t in plan.layers[i]])
                time.sleep(0.05)   # the next layer's read is done: only the rule holds its copy back
                assert (i + 1 in reader._ready) == (in_flight == 2 and i < 4)   # the next one copied already
                reader.release(i)
    assert len(buffers) == made


@pytest.mark.parametrize("into", ["mlx", "pinned"])
def test_a_layer_not_released_keeps_its_bytes_while_later_passes_read(tmp_path, into):
    tensors = make_model(tmp_path, layers=4)
    plan = load_plan(tmp_path)
    names = [[t.name for t in layer] for layer in plan.layers]
    with WeightReader(plan, into=into, engine=HostCopy()) as reader:
        reader.start_pass()
        held = [reader.take(i) for i in range(4)]
        reader.release(0)                           # not the layer taken last: ignored
        reader.start_pass([3, 1, 2])
        for i in (3, 1):
            reader.take(i)
            reader.release(i)
        held.append(reader.take(2))                # the pass is abandoned with layer 2 taken, not released
        for _ in range(3):
            reader.start_pass()
            for i in range(4):
                reader.take(i)
                reader.release(i)
    for i, got in enumerate(held):
        check_layer(got, tensors, names[i if i < 4 else 2])


@pytest.mark.parametrize("release", [True, False])
def test_compute_on_the_main_thread_while_the_reader_converts(tmp_path, release):
    """MLX arrays made and evaluated on the convert thread, used at once by the compute thread."""
    hidden, layers = 64, 4
    tensors = make_model(tmp_path, model_tensors(layers=layers, hidden=hidden, dtype="F32"))
    plan = load_plan(tmp_path)
    x = mx.ones((16, hidden))
    want = []
    for i in range(layers):
        w = np.nan_to_num(tensors[f"model.layers.{i}.self_attn.q_proj.weight"][1], nan=0, posinf=0, neginf=0)
        want.append(np.clip(w, -1, 1).sum())
    with WeightReader(plan, dtype=mx.float32) as reader:
        for _ in range(60):
            reader.start_pass()
            for i in range(layers):
                w = reader.take(i)["model.layers.%d.self_attn.q_proj.weight" % i]
                w = mx.clip(mx.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0), -1, 1)
                y = (x @ w.T).sum() / 16
                assert abs(y.item() - want[i]) <= 1e-3 * max(1.0, abs(want[i]))
                if release:
                    del w
                    reader.release(i)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page cache probe uses Linux mincore")
@pytest.mark.parametrize("read_ahead,direct", [(True, False), (False, False), (True, True)])
def test_reader_leaves_nothing_in_the_page_cache(tmp_path, read_ahead, direct):
    make_model(tmp_path, model_tensors(layers=4, hidden=256), index=False)   # ~2 MB, 500+ pages
    path = tmp_path / "model.safetensors"
    drop_from_cache(path)
    with open(path, "rb") as f:                     # start fully cached: the reader must drop it
        f.read()
    assert cached_pages(path)[0] == cached_pages(path)[1]
    plan = load_plan(tmp_path)
    with WeightReader(plan, read_ahead=read_ahead, direct=direct) as reader:
        assert reader.direct == direct
        reader.read_resident()
        for _ in range(2):
            reader.start_pass()
            for i in range(4):
                reader.take(i)
    assert cached_pages(path)[0] == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reader drops pages only on Linux")
def test_control_without_drop_cache_stays_cached(tmp_path, monkeypatch):
    """Counted at the drop, not by mincore afterwards: another process's memory pressure may evict the pages first."""
    make_model(tmp_path, model_tensors(layers=4, hidden=256), index=False)
    plan = load_plan(tmp_path)   # it drops the header it read
    fadvise, dropped = os.posix_fadvise, []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, n, advice: dropped.append((offset, n))
                        if advice == os.POSIX_FADV_DONTNEED else fadvise(fd, offset, n, advice))
    with WeightReader(plan, drop_cache=False) as reader:
        assert not reader.direct                     # its reads go through the page cache
        reader.read_resident()
        reader.start_pass()
        for i in range(4):
            reader.take(i)
    assert dropped == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_without_admission_the_reader_sets_the_cache_limit_admission_prices(make_tiny, dtype):
    from spill.admission.prices import sheet_for
    plan = load_plan(make_tiny("llama", dtype=dtype))
    previous = mx.set_cache_limit(0)
    try:
        WeightReader(plan, dtype=mx.float32).close()
        assert mx.set_cache_limit(previous) == sheet_for(plan, 2**30, 4, prefill_tokens=64).fixed["cache"]   # KV's share aside
    finally:
        mx.set_cache_limit(previous)


def test_on_a_gpu_tensors_not_at_256_bytes_are_copied_bit_for_bit(model):
    plan, tensors = model
    with WeightReader(plan) as reader:
        reader.tensors.align = 256   # what a GPU's matmuls need (set at start from the default device)
        reader.start_pass()
        for i, layer in enumerate(plan.layers):
            check_layer(reader.take(i), tensors, [t.name for t in layer])
