"""OpenBLAS's thread count set by the engine (SPILL_BLAS_THREADS), in a process with it preloaded."""

import os
import subprocess
import sys

import pytest

from spill.platform import OPENBLAS, preload_env

SCRIPT = """
import ctypes, sys
import mlx.core as mx
from spill.platform import set_blas_threads
from spill.streamer.core import Streamer
get = ctypes.CDLL(None).openblas_get_num_threads
assert set_blas_threads(0) and get() >= 1            # 0 leaves OpenBLAS's own count
mx.set_default_device(mx.cpu)
Streamer(sys.argv[1]).close()                        # SPILL_BLAS_THREADS=3 in the environment
print(get())
"""


@pytest.mark.skipif(not os.path.exists(OPENBLAS), reason="no OpenBLAS to preload on this machine")
def test_the_streamer_sets_openblas_threads_on_the_cpu(make_tiny):
    env = {**os.environ, "SPILL_BLAS_THREADS": "3"}
    env.pop("SPILL_NO_OPENBLAS", None)
    env = preload_env(env)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(make_tiny("llama"))], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "3"


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


HEAP_SCRIPT = """
import ctypes, sys
import mlx.core as mx
from spill.streamer.core import Streamer
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[2] == "streamer":
    mx.set_default_device(mx.cpu)
    Streamer(sys.argv[1]).close()
libc.free(libc.malloc(24 << 20))          # glibc's default raises its mmap threshold to this block
block = libc.malloc(4 << 20)              # a layer-sized buffer after it
heap = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
lo, hi = (int(x, 16) for x in heap[0].split("-")) if heap else (0, 0)
print("heap" if lo <= block < hi else "mapped")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("who", ["nobody", "streamer"])
def test_the_streamer_keeps_layer_sized_buffers_out_of_the_heap(make_tiny, who):
    out = subprocess.run([sys.executable, "-c", HEAP_SCRIPT, str(make_tiny("llama")), who],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == ("mapped" if who == "streamer" else "heap")   # the default: the hole stays
