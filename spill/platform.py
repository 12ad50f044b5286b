"""What the platform needs before MLX starts: on Linux CPU, OpenBLAS preloaded for float32 matmuls.

MLX's Linux CPU wheel links a slow reference BLAS (~4 GFLOP/s here); Debian's OpenBLAS
(package libopenblas0-pthread) preloaded makes float32 matmuls 20-40x faster.
"""

import ctypes
import os
import subprocess
import sys

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
# OpenBLAS's idle threads spin ~2^28 cycles after a GEMM, taking the cores the reader and converters need
# between the layer's matmuls; at 2^4 they sleep at once (benchmarks/pass_time.py, 16 cores, batch 8:
# pass/IO 1.23 at OpenBLAS's default, 1.12 at 2^4)
THREAD_TIMEOUT = "4"
_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None
_CANDIDATES = [OPENBLAS, "/usr/lib/aarch64-linux-gnu/libopenblas.so.0"]


def without_torch() -> None:
    """transformers imports torch whenever it is installed (~400 MB in each process that tokenizes);
    spill uses none of it, so its processes tell Python there is none (unless already imported)."""
    sys.modules.setdefault("torch", None)


def preload_env(env: dict | None = None) -> dict:
    """A copy of `env` with OpenBLAS added to LD_PRELOAD where it exists (Linux only), its threads set to
    sleep as soon as a GEMM ends unless the user chose OPENBLAS_THREAD_TIMEOUT."""
    from spill import config
    env = dict(os.environ if env is None else env)
    if not sys.platform.startswith("linux") or config.no_openblas(env):
        return env
    lib = next((p for p in _CANDIDATES if os.path.exists(p)), None)
    current = env.get("LD_PRELOAD", "")
    if lib and lib not in current.split(":"):
        env["LD_PRELOAD"] = f"{lib}:{current}" if current else lib
    if lib:
        env.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)
    return env


def reexec_with_preload(argv: list[str] | None = None) -> None:
    """Restart this command (`argv`, default `spill`'s) once with OpenBLAS preloaded, if it is not already."""
    from spill import config
    env = preload_env()
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD") and not config.get("_SPILL_REEXEC"):
        env["_SPILL_REEXEC"] = "1"
        argv = argv or ["-m", "spill.coordinator.cli", *sys.argv[1:]]
        os.execve(sys.executable, [sys.executable, *argv], env)


def openblas_missing() -> bool:
    """True on Linux when no OpenBLAS can be preloaded (and the user did not opt out with SPILL_NO_OPENBLAS)."""
    from spill import config
    if not sys.platform.startswith("linux") or config.no_openblas():
        return False
    return not any(os.path.exists(p) for p in _CANDIDATES)


_KNOWN: dict = {}   # {"device": str, "memory": int}: the coordinator's answer, an argument of the processes it starts


def use_device(known: dict | None) -> None:
    """Take device() and device_memory() as the coordinator learnt them (an actor's `device` argument)."""
    _KNOWN.clear()
    _KNOWN.update(known or {})


def device() -> str:
    """MLX's default device: "cpu" or "gpu-<name>". As the coordinator learnt it where it did, so a process that
    never computes does not load MLX (its CUDA backend costs each process ~140 MB)."""
    if _KNOWN.get("device"):
        return _KNOWN["device"]
    import mlx.core as mx
    if mx.default_device() == mx.cpu:
        return "cpu"
    try:
        name = mx.device_info().get("device_name", "gpu")
    except Exception:   # noqa: BLE001 - an MLX without device_info: the kind is still known
        name = "gpu"
    return f"gpu-{name}"


def device_memory() -> int | None:
    """A CUDA GPU's memory, which MLX's arrays there must fit: what is free when the group learns it (MLX reads it
    system-wide, so a desktop's or another job's is left to them), else its total; None on a CPU and on Apple
    silicon (whose working set Metal gives). As the coordinator learnt it where it did."""
    if not on_cuda():
        return None
    if "memory" in _KNOWN:
        return int(_KNOWN["memory"]) or None
    import mlx.core as mx
    info = mx.device_info()
    return int(info.get("free_memory") or info.get("total_memory") or info.get("memory_size") or 0) or None


def learn_device() -> dict:
    """device() and device_memory() as {"device", "memory"}, asked of MLX in a short-lived child and kept for this
    process, which hands them to those it starts: the coordinator learns them without loading MLX."""
    if not _KNOWN.get("device"):
        code = "from spill.platform import device, device_memory; print(device()); print(device_memory() or 0)"
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
            answer = done.stdout.strip().splitlines()[-2:] if done.returncode == 0 else []
        except (OSError, subprocess.SubprocessError):
            answer = []
        if len(answer) == 2 and answer[1].isdigit():
            use_device({"device": answer[0], "memory": int(answer[1])})
        else:   # asked here, loading MLX
            use_device({"device": device()})
            _KNOWN["memory"] = device_memory() or 0
    return dict(_KNOWN)


def on_cpu() -> bool:
    return device() == "cpu"


def on_cuda() -> bool:
    """A GPU that is not Apple's: MLX's CUDA backend, its own memory and managed memory for host arrays."""
    return device().startswith("gpu") and sys.platform != "darwin"


def default_dtype():
    """The streamer's compute dtype: float32 on the CPU (MLX's bf16 matmul is slow there), None (the
    stored dtype) on a GPU. Here, not in the streamer, so pricing a model imports no mlx-lm."""
    import mlx.core as mx
    return mx.float32 if on_cpu() else None


def read_slots() -> int:
    """The reader's read-ahead buffers (config.read_slots where set): two, so a read never waits for the
    layer before it to be converted, except on a CPU of fewer than 8 cores, where that wait is short and
    the second buffer's layer of memory buys more KV. `benchmarks/pass_time.py` under SPILL_READ_SLOTS=1 and 2
    measures it: 16 cores, llama 3b, batches 8/32/128: 2.89/3.53/3.63 s a pass with two, 4.16/4.25/5.10 with
    one; 2 vCPUs, lean45: a pass 1.02-1.05x its read with two, 1.10-1.15x with one, and 57 MiB less KV."""
    from spill import config
    small_cpu = on_cpu() and (os.cpu_count() or 1) < 8
    return config.read_slots() or (1 if small_cpu else 2)


def layers_in_flight() -> int:
    """Layers of converted weights alive at once while streaming (config.layers_in_flight where set): two, the one
    computing and the next, so a conversion overlaps the compute; one on a CUDA GPU, where the copy engine fills a
    layer in milliseconds beside a read of ~100 ms, and a layer of GPU memory more holds ~20 rows of llama 3b's KV."""
    from spill import config
    return config.layers_in_flight() or (1 if on_cuda() else 2)


def activation_streams() -> int:
    """MLX CPU streams a layer's SwiGLU and a prompt's attention are split over (config.activation_streams where
    set): one a core, at most 8, on a CPU; one (no split) on a GPU. MLX's CPU backend runs an op on one thread,
    unvectorized on x86: 184 rows of lean45's SwiGLU took 10.4 ms a layer on one of 2 vCPUs (0.47 s of a 2.17 s
    pass), 5.6 ms split over both."""
    from spill import config
    chosen = config.activation_streams()
    if chosen is not None:
        return max(1, chosen)
    return min(8, _cores()) if on_cpu() else 1


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def chunk_attention() -> str:
    """How a decode chunk of drafts attends (config SPILL_CHUNK_ATTENTION): "ops" on a CUDA GPU, whose fused
    kernel of 2+ queries a row makes a cuDNN plan for each new shape (~40 ms on an H100); "fused" elsewhere."""
    from spill import config
    return config.chunk_attention() or ("ops" if on_cuda() else "fused")


def read_into() -> str:
    """Where the reader reads each layer (config.read_into): "mlx", straight into MLX memory; on a CUDA GPU
    "pinned", into its own page-locked buffers that the GPU's copy engine copies out. O_DIRECT into MLX's
    managed memory there now and then left tensors wrong (4 of 12 tiny-model checks failed on the H200 under
    `benchmarks/check_repeat.py`), and a host copy into it ("buffers") cost a pass 1.35x its read
    (`benchmarks/pass_time.py` under SPILL_READ_INTO=buffers)."""
    from spill import config
    return config.read_into() or ("pinned" if on_cuda() else "mlx")


def recycles_layers(into: str | None = None) -> bool:
    """Whether the reader fills the MLX memory of a layer the compute thread released, so no freed layer waits
    in MLX's cache: reading into MLX memory on the CPU (on the H200's GPU it was not faster), and "pinned"."""
    into = into or read_into()
    return into == "pinned" or (on_cpu() and into == "mlx")


def set_blas_threads(n: int) -> bool:
    """Set the loaded OpenBLAS's thread count at run time (n > 0); False where none is loaded."""
    try:
        setter = ctypes.CDLL(None).openblas_set_num_threads
    except (OSError, AttributeError):
        return False
    if n > 0:
        setter(int(n))
    return True


BIG_PRODUCT = 96    # rows of a matmul from which every core beats leaving one to the reader (benchmarks/cpu_threads.py,
                    # 2 vCPUs: 64 rows 3.59 s on one thread, 3.86 on two; 128 rows 5.05 on one, 4.34 on two)


def blas_threads_for(rows: int, chosen: int = 0, reading: bool = True) -> int:
    """OpenBLAS threads for a pass whose largest matmul has `rows` rows: `chosen` (SPILL_BLAS_THREADS) if
    set; else every core for a large product (a long prefill chunk) or a pass that reads no layer (resident
    weights), one core fewer for decode's small ones, so the weight reader keeps a core (`benchmarks/cpu_threads.py`,
    2 vCPUs, 16 rows: 1.58 s of compute on 2 threads, 1.22 on 1; resident, 32 rows: 0.45 s on 2, 0.62 on 1)."""
    if chosen > 0:
        return chosen
    cores = _cores()
    return cores if rows >= BIG_PRODUCT or not reading else max(1, cores - 1)


def release_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim): buffers MLX frees otherwise stay in
    the process's RSS (measured: 35 MiB after a 512-token prefill of the factory's lean model)."""
    if _TRIM is not None:
        _TRIM(0)
