"""Each step of the read path alone, in GB/s, on this machine: where a pass's time can go.

    python benchmarks/read_path.py MODEL_FOLDER [--threads 4] [--json out.json]
    python benchmarks/read_path.py MODEL_FOLDER --reader 2 [--into pinned,buffers]   # the reader's passes

Disk (every read from cold, over all the model's shards): buffered reads dropping behind, on 1 and
N threads; O_DIRECT into shared anonymous memory (4 KiB pages), on 1 and N threads, into huge pages
as the reader reads, and into MLX-owned memory. Memory (a 512 MiB buffer, no disk): numpy ->
mx.array copy, bf16 -> f32 in MLX and in numpy on N threads; on a GPU, the first kernel that reads
host-written arrays (the page migration a layer pays), and the copy engine's copy out of pinned memory.
"""

import argparse
import json
import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pass_time import drop_cache  # noqa: E402

from spill.streamer.pages import aligned_buffer  # noqa: E402

GB = 1e9
_ALIGN = 4096


def _chunks(files, chunk):
    for f in files:
        size = f.stat().st_size
        yield from ((f, off, min(chunk, size - off)) for off in range(0, size, chunk))


def disk(files, threads: int, chunk: int, direct: bool, into=None) -> float:
    """GB/s of reading every file once from cold; `into(n)` gives a writable buffer of n bytes."""
    drop_cache(files)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = {f: os.open(f, flags) for f in files}
    local = threading.local()

    def one(job):
        f, off, n = job
        if not hasattr(local, "buf"):
            local.buf = into(chunk) if into else memoryview(mmap.mmap(-1, chunk))
        want = -(-n // _ALIGN) * _ALIGN if direct else n
        got = os.preadv(fds[f], [local.buf[:want]], off)
        if not direct:
            os.posix_fadvise(fds[f], off, got, os.POSIX_FADV_DONTNEED)
        return min(got, n)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, _chunks(files, chunk)))
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return total / dt / GB


def timed(fn, nbytes, reps=3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / GB


def reader_passes(folder, reps: int, settings: str) -> dict:
    """The reader's passes alone from cold under each `into` setting (read, convert, a kernel reading every
    tensor, release), alternating: where a pass's seconds go, the copy engine's and new MLX buffers' apart."""
    import mlx.core as mx
    from spill.streamer import gpu_copy, mlx_buffers, reader
    from spill.streamer.core import default_dtype
    from spill.streamer.plan import load_plan
    plan, files, out, spent = load_plan(folder), sorted(Path(folder).glob("*.safetensors")), {}, {}

    def timing(name, fn):
        def timed_fn(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return timed_fn
    engine = gpu_copy.engine()
    if engine is not None:
        engine.copy = timing("copy", engine.copy)
    reader.gpu_buffer = timing("new GPU buffers", mlx_buffers.gpu_buffer)
    for _ in range(reps):
        for into in settings.split(","):
            with reader.WeightReader(plan, dtype=default_dtype(), into=into.split("/")[0], engine=engine) as rd:
                if into == "pinned/gpu-views":        # the tensors' views made on the GPU's stream, as before
                    rd.tensors.view_stream = None
                for k in range(2):                    # the second pass recycles what the first made
                    drop_cache(files)
                    spent.clear()
                    t0, s0, kernel = time.perf_counter(), rd.stats(), 0.0
                    rd.start_pass()
                    for i in range(len(plan.layers)):
                        weights = rd.take(i)
                        k0 = time.perf_counter()
                        mx.eval([w.sum() for w in weights.values()])
                        kernel += time.perf_counter() - k0
                        del weights
                        rd.release(i)
                    dt, st = time.perf_counter() - t0, rd.stats()
                made = rd.buffers_made
            line = {"pass GB/s": plan.streamed_bytes / dt / GB,
                    "reads GB/s": (st["bytes_read"] - s0["bytes_read"]) / (st["read_s"] - s0["read_s"]) / GB,
                    "convert s": st["convert_s"] - s0["convert_s"], "kernels s": kernel,
                    **{f"{k} s": v for k, v in spent.items()}, "MLX buffers made (2 passes)": made}
            out.setdefault(f"reader pass, into {into}", []).append({k: round(v, 3) for k, v in line.items()})
            print(f"into {into}: {out[f'reader pass, into {into}'][-1]}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--json", default="")
    p.add_argument("--reader", type=int, default=0, help="only the reader's passes under each --into, N times")
    p.add_argument("--into", default="pinned,pinned/gpu-views,buffers",
                   help="the reader's settings for --reader (spill/config.py)")
    a = p.parse_args()
    if a.reader:
        out = reader_passes(a.model, a.reader, a.into)
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
        return
    import mlx.core as mx
    import numpy as np
    files = sorted(Path(a.model).glob("*.safetensors"))
    gpu = mx.default_device() == mx.gpu
    out = {"device": "gpu" if gpu else "cpu", "cores": os.cpu_count(), "bytes": sum(f.stat().st_size for f in files)}
    n = a.threads

    def mlx_memory(size):   # MLX-owned bytes, filled on the host, as a writable page-aligned memoryview
        arr = mx.zeros((size + _ALIGN,), mx.uint8, stream=mx.cpu)
        mx.eval(arr)
        keep.append(arr)
        view = np.asarray(memoryview(arr))
        skip = -view.ctypes.data % _ALIGN
        return memoryview(view[skip:skip + size])
    keep = []
    for name, kw in [("buffered 1 thread 64 MiB", dict(threads=1, chunk=64 << 20, direct=False)),
                     (f"buffered {n} threads 16 MiB", dict(threads=n, chunk=16 << 20, direct=False)),
                     ("O_DIRECT 1 thread 64 MiB", dict(threads=1, chunk=64 << 20, direct=True)),
                     (f"O_DIRECT {n} threads 16 MiB", dict(threads=n, chunk=16 << 20, direct=True)),
                     (f"O_DIRECT {n} threads 16 MiB into huge pages (the reader's buffers)",
                      dict(threads=n, chunk=16 << 20, direct=True, into=lambda size: memoryview(aligned_buffer(size)))),
                     (f"O_DIRECT {n} threads 16 MiB into MLX memory", dict(threads=n, chunk=16 << 20, direct=True,
                                                                           into=mlx_memory))]:
        out[name] = [round(disk(files, **kw), 2) for _ in range(2)]
        print(f"{name}: {out[name]} GB/s", flush=True)
    keep.clear()

    size = 512 << 20
    src = np.frombuffer(np.random.default_rng(0).bytes(size), np.uint16)
    src = src & 0x7F7F   # finite bf16 values

    def to_mx():
        mx.eval(mx.array(src))
    out["numpy -> mx.array copy"] = round(timed(to_mx, size), 2)

    bf = mx.array(src).view(mx.bfloat16)
    mx.eval(bf)

    def cast_mlx():
        mx.eval(bf.astype(mx.float32, stream=mx.cpu))
    out["bf16 -> f32, MLX on the CPU (bytes in)"] = round(timed(cast_mlx, size), 2)

    def cast_np():
        dst = mx.zeros((src.size,), mx.float32, stream=mx.cpu)
        mx.eval(dst)
        d = np.asarray(memoryview(dst)).view(np.uint32)
        cuts = [src.size * k // n for k in range(n + 1)]
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda k: np.left_shift(src[cuts[k]:cuts[k + 1]], 16, out=d[cuts[k]:cuts[k + 1]],
                                                  dtype=np.uint32), range(n)))
    out[f"bf16 -> f32, numpy on {n} threads into MLX memory, allocation included (bytes in)"] = round(timed(cast_np, size), 2)

    def alloc():
        mx.eval(mx.zeros((size,), mx.uint8, stream=mx.cpu))
    out["MLX allocation + zero fill on the host"] = round(timed(alloc, size), 2)

    if gpu:
        def copy_then_gpu():
            mx.eval(mx.array(src).view(mx.bfloat16).sum())
        out["GPU: mx.array(numpy) + first kernel reading it"] = round(timed(copy_then_gpu, size), 2)

        def host_then_gpu():
            arr = mx.zeros((src.size,), mx.uint16, stream=mx.cpu)
            mx.eval(arr)
            np.asarray(memoryview(arr))[:] = src
            t0 = time.perf_counter()
            mx.eval(arr.view(mx.bfloat16).sum())
            host_then_gpu.kernel = time.perf_counter() - t0
        out["GPU: host zeros + numpy write + first kernel"] = round(timed(host_then_gpu, size), 2)
        out["GPU: first kernel alone on host-written memory"] = round(size / host_then_gpu.kernel / GB, 2)
        resident = mx.array(src).view(mx.bfloat16)
        mx.eval(resident.sum())
        out["GPU: kernel on memory already on the GPU"] = round(timed(lambda: mx.eval(resident.sum()), size), 2)
        from spill.streamer import gpu_copy, mlx_buffers
        engine = gpu_copy.engine()
        host = aligned_buffer(size)
        host[:] = src.view(np.uint8)
        engine.pin(host)
        raw, skip, addr = mlx_buffers.gpu_buffer(size)
        copied = raw[skip:skip + size]
        out["GPU: copy engine, pinned buffer -> MLX memory (the reader's default)"] = round(
            timed(lambda: engine.copy(addr, host.ctypes.data, size), size), 2)
        out["GPU: copy engine's bytes equal the buffer's"] = bool(mx.array_equal(copied, mx.array(host)).item())

        def copy_then_kernel():
            engine.copy(addr, host.ctypes.data, size)
            mx.eval(copied.view(mx.bfloat16).sum())
        out["GPU: copy engine + first kernel reading it"] = round(timed(copy_then_kernel, size), 2)
        pinned = aligned_buffer(n * (16 << 20))   # a chunk a thread
        engine.pin(pinned)

        def pinned_chunks():
            it = iter(range(n))
            return lambda size: memoryview(pinned[next(it) * size:][:size])
        out[f"O_DIRECT {n} threads 16 MiB into pinned huge pages"] = [round(disk(
            files, threads=n, chunk=16 << 20, direct=True, into=pinned_chunks()), 2) for _ in range(2)]
        engine.unpin(pinned)
        engine.unpin(host)
    for k, v in out.items():
        print(f"{k}: {v}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
