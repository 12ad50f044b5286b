"""The platform layer: OpenBLAS's thread count set by the engine (SPILL_BLAS_THREADS), and the device as
the processes that never compute learn it (the coordinator's answer, an argument of each actor)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spill.platform import OPENBLAS, preload_env

SCRIPT = """
import ctypes, sys
import mlx.core as mx
from spill.platform import set_blas_threads
from spill.streamer.core import Row, Streamer
get = ctypes.CDLL(None).openblas_get_num_threads
assert set_blas_threads(0) and get() >= 1            # 0 leaves OpenBLAS's own count
mx.set_default_device(mx.cpu)
s = Streamer(sys.argv[1])                            # SPILL_BLAS_THREADS=3 in the environment
s.add(Row("a", [1, 2, 3], 2))
s.step()
s.close()
print(get())
"""

PER_PASS = """
import ctypes, json, os, sys
import mlx.core as mx
from spill.streamer.core import Row, Streamer
get = ctypes.CDLL(None).openblas_get_num_threads
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
mx.set_default_device(mx.cpu)
resident, prompt = json.loads(sys.argv[2])
s = Streamer(sys.argv[1], prefill_chunk=512, resident=resident)
s.add(Row("a", [i % 200 + 1 for i in range(prompt)], 3))
s.step()
first = get()
s.step()
print(first, get())
s.close()
"""


def _threads_per_pass(folder, resident: bool, prompt: int) -> list[str]:
    """OpenBLAS's threads in the first pass (the prompt) and the second (decode), on 2 cores."""
    env = preload_env({k: v for k, v in os.environ.items() if k not in ("SPILL_NO_OPENBLAS", "SPILL_BLAS_THREADS")})
    out = subprocess.run([sys.executable, "-c", PER_PASS, str(folder), json.dumps([resident, prompt])], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not os.path.exists(OPENBLAS), reason="no OpenBLAS to preload on this machine")
def test_the_streamer_sets_openblas_threads_on_the_cpu(make_tiny):
    env = {**os.environ, "SPILL_BLAS_THREADS": "3"}
    env.pop("SPILL_NO_OPENBLAS", None)
    env = preload_env(env)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(make_tiny("llama"))], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "3"


@pytest.mark.skipif(not os.path.exists(OPENBLAS) or len(os.sched_getaffinity(0)) < 2,
                    reason="no OpenBLAS to preload, or one core")
def test_a_decode_pass_leaves_the_reader_a_core_and_a_long_prefill_takes_them_all(make_tiny):
    """2 vCPUs: 16 rows decoding computed in 1.58 s on two OpenBLAS threads beside the reader, 1.22 s on one;
    a 512-token prefill in 14.9 s on two, 17.9 on one."""
    assert _threads_per_pass(make_tiny("llama"), resident=False, prompt=128) == ["2", "1"]


def test_no_openblas_loaded_is_false_not_an_error():
    out = subprocess.run([sys.executable, "-c", "from spill.platform import set_blas_threads as s; print(s(2))"],
                         env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not os.path.exists(OPENBLAS), reason="no OpenBLAS to preload on this machine")
def test_openblas_threads_sleep_after_a_gemm_unless_the_user_chose_otherwise():
    base = {k: v for k, v in os.environ.items() if k not in ("SPILL_NO_OPENBLAS", "OPENBLAS_THREAD_TIMEOUT")}
    assert preload_env(base)["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert preload_env({**base, "OPENBLAS_THREAD_TIMEOUT": "20"})["OPENBLAS_THREAD_TIMEOUT"] == "20"
    assert "OPENBLAS_THREAD_TIMEOUT" not in preload_env({**base, "SPILL_NO_OPENBLAS": "1"})


@pytest.mark.skipif(not os.path.exists(OPENBLAS), reason="no OpenBLAS to preload on this machine")
def test_the_openblas_kernels_in_use_are_named_for_a_benchmarks_header():
    # a machine may force older kernels (OPENBLAS_CORETYPE): a benchmark must say which ran
    def core(env: dict) -> str:
        code = "from tests.machine import blas_core; print(blas_core())"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                              cwd=Path(__file__).resolve().parents[2])
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "SPILL_NO_OPENBLAS", "LD_PRE"))}
    assert core(preload_env({**base, "OPENBLAS_CORETYPE": "Haswell"})) == "Haswell"
    assert core(preload_env(base)) not in ("", "Unknown")
    assert core(base) == ""


def _fresh(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_device_the_coordinator_learned_is_read_without_loading_mlx():
    code = ("import sys; from spill.platform import device, on_cpu, read_slots, recycles_layers, use_device\n"
            "use_device({'device': 'gpu-NVIDIA H200'})   # an actor's argument (spill.actor.run_actor)\n"
            "print(device(), on_cpu(), read_slots(), recycles_layers(), 'mlx.core' in sys.modules)")
    assert _fresh(code) == "gpu-NVIDIA H200 False 2 True False"   # "pinned"


def test_learn_device_asks_mlx_in_a_child_and_keeps_the_answer():
    code = ("import sys; from spill.platform import device, learn_device\n"
            "print(learn_device(), device(), 'mlx.core' in sys.modules)")
    assert _fresh(code) == "{'device': 'cpu', 'memory': 0} cpu False"   # this machine's MLX has no GPU


@pytest.mark.parametrize("device,platform_name,memory", [("gpu-NVIDIA H200", "linux", 150 * 2**30),
                                                         ("gpu-Apple M3 Max", "darwin", None), ("cpu", "linux", None)])
def test_a_cuda_gpus_memory_is_read_from_the_coordinators_answer(device, platform_name, memory, monkeypatch, on_device):
    from spill import platform
    on_device(device, 150 * 2**30)
    monkeypatch.setattr(platform.sys, "platform", platform_name)
    assert platform.device_memory() == memory


def test_a_cuda_gpu_is_budgeted_from_the_memory_free_when_the_group_learns_it(monkeypatch, on_device):
    """A GPU shared with a desktop or another job: 0.90 of its total would overrun what it leaves; MLX's device_info
    says what is free (NVML's, system-wide), and an MLX that does not is read for its total as before."""
    import mlx.core as mx
    from spill import platform
    on_device("gpu-NVIDIA RTX")
    monkeypatch.setattr(platform.sys, "platform", "linux")
    monkeypatch.setattr(mx, "device_info", lambda: {"total_memory": 24 * 2**30, "free_memory": 21 * 2**30})
    assert platform.device_memory() == 21 * 2**30
    monkeypatch.setattr(mx, "device_info", lambda: {"total_memory": 24 * 2**30})
    assert platform.device_memory() == 24 * 2**30


@pytest.mark.parametrize("device,chosen,into,recycles", [
    ("cpu", None, "mlx", True), ("gpu-NVIDIA H200", None, "pinned", True),
    ("gpu-NVIDIA H200", "mlx", "mlx", False), ("cpu", "buffers", "buffers", False)])
def test_a_cuda_gpus_reader_reads_into_pinned_buffers_unless_told(device, chosen, into, recycles, monkeypatch,
                                                                 on_device):
    """O_DIRECT reads into MLX's CUDA (managed) memory left tensors wrong now and then: 4 of 12 tiny-model GPU
    checks failed, 0 of 12 reading into the reader's buffers (benchmarks/check_repeat.py, docs/benchmarks.md);
    a host copy out of those cost a pass 1.35x its read, so there the GPU's copy engine copies (gpu_copy.py)."""
    from spill import platform
    on_device(device)
    monkeypatch.setattr(platform.sys, "platform", "linux")
    if chosen is None:
        monkeypatch.delenv("SPILL_READ_INTO", raising=False)
    else:
        monkeypatch.setenv("SPILL_READ_INTO", chosen)
    assert platform.read_into() == into
    assert platform.recycles_layers() is recycles   # what admission prices for MLX's cache


def test_a_reader_setting_that_is_not_one_is_a_sentence(monkeypatch):
    from spill import platform
    from spill.errors import SpillError
    monkeypatch.setenv("SPILL_READ_INTO", "gpu")
    with pytest.raises(SpillError, match="use mlx, buffers or pinned"):
        platform.read_into()


@pytest.mark.parametrize("device,platform_name,backend", [("cpu", "linux", "cpu"), ("cpu", "darwin", "cpu"),
                                                          ("gpu-NVIDIA H200", "linux", "cuda"),
                                                          ("gpu-Apple M3 Max", "darwin", "metal")])
def test_the_build_metric_names_the_device_the_supervisor_learned(device, platform_name, backend, monkeypatch,
                                                                  on_device):
    """Not the installed wheels: MLX's CUDA build on a machine without a GPU computes on the CPU."""
    from spill import metrics
    on_device(device)
    monkeypatch.setattr(sys, "platform", platform_name)
    metrics._backend.cache_clear()
    assert metrics._backend() == backend
    metrics._backend.cache_clear()


@pytest.mark.skipif(not os.path.exists(OPENBLAS) or len(os.sched_getaffinity(0)) < 2,
                    reason="no OpenBLAS to preload, or one core")
def test_a_pass_that_reads_nothing_takes_every_core(make_tiny):
    """Resident weights (lean45, 2 vCPUs): nothing reads beside the decode, so both cores compute (32 rows: 0.45 s a
    pass on two OpenBLAS threads, 0.62 on one); the first pass, which reads every layer, leaves the reader a core."""
    assert _threads_per_pass(make_tiny("llama"), resident=True, prompt=3) == ["1", "2"]
