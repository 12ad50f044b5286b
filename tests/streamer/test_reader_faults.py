"""The reader's threads failing: whatever raises in them is raised by take() and start_pass, never a hang."""

import os
import threading

import pytest

from ._safetensors_util import make_model

from spill.streamer import reader as reader_mod
from spill.streamer.plan import load_plan
from spill.streamer.reader import WeightReader


@pytest.mark.parametrize("where, fail_on", [("host_buffer", 1), ("host_buffer", 2), ("_drop_files", 1)])
def test_a_failure_in_the_reader_s_threads_is_raised_by_take_not_a_hang(tmp_path, monkeypatch, where, fail_on):
    """MLX raises where it cannot allocate (Metal): the failing buffer is the first read's, or the one a slot takes
    once its layer is converted; or dropping the files' cache after the last read fails. take() raises it instead
    of waiting for a thread that died."""
    make_model(tmp_path, layers=3)
    calls, real = [], getattr(reader_mod.WeightReader, where, None) or reader_mod.host_buffer
    def failing(*args):
        calls.append(args)
        if len(calls) == fail_on:
            raise RuntimeError("[malloc] Unable to allocate")
        return real(*args)
    monkeypatch.setattr(reader_mod.WeightReader if where == "_drop_files" else reader_mod, where, failing)
    with WeightReader(load_plan(tmp_path), into="mlx") as reader:
        reader.start_pass()
        got = []
        taker = threading.Thread(target=lambda: got.append(_raised(lambda: [reader.take(i) for i in range(3)])))
        taker.start()
        taker.join(30)
        assert not taker.is_alive(), "take() still waiting"
        assert got == ["RuntimeError: [malloc] Unable to allocate"]


def test_a_reader_thread_that_dies_is_named_by_take_and_start_pass(tmp_path, monkeypatch):
    make_model(tmp_path, layers=3)
    with WeightReader(load_plan(tmp_path), into="mlx") as reader:
        monkeypatch.setattr(reader, "_job", lambda *a: 1 / 0)   # a defect outside any one read
        reader.start_pass()
        got = []
        taker = threading.Thread(target=lambda: got.append(_raised(lambda: reader.take(0))))
        taker.start()
        taker.join(30)
        assert not taker.is_alive(), "take() still waiting"
        assert got[0].startswith("RuntimeError: the weight reader's spill-read thread stopped (ZeroDivisionError:")
        assert _raised(reader.start_pass) == got[0]


@pytest.mark.parametrize("keep", [0, 1000])
def test_a_shard_cut_short_after_the_plan_is_named_with_the_size_it_has_now(tmp_path, keep):
    """Emptied, or cut inside the embedding (8 KiB, before the layers): the sentence gives the file's end, not the
    page the layer's read began at."""
    make_model(tmp_path, layers=3, hidden=128, shards=1, index=False)
    plan = load_plan(tmp_path)
    os.truncate(tmp_path / "model.safetensors", keep)
    with WeightReader(plan, into="mlx") as reader:
        reader.start_pass()
        said = _raised(lambda: [reader.take(i) for i in range(3)])
    assert said.startswith(f"SpillError: {tmp_path / 'model.safetensors'}: expected "), said
    assert said.endswith(f", found the file ending at byte {keep}; it changed after the plan was made, re-download it")


def _raised(work) -> str:
    try:
        work()
    except Exception as err:  # noqa: BLE001 - the test compares what was raised
        return f"{type(err).__name__}: {err}"
    return "nothing raised"
