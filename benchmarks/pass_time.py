"""Pass time against the IO roofline, measured in one run on one machine (DESIGN.md sections 2 and 9).

    python benchmarks/pass_time.py [--size 3b] [--family llama] [--batches 1,8,32,128] [--passes 4]

1. builds (or reuses) a factory model under --models, 2. measures the cold read bandwidth of its
shards two ways (page cache dropping behind; O_DIRECT into huge pages on the reader's threads), before
and after the passes, 3. times decode passes of the streamer per batch against IO (bytes / the faster
way's median bandwidth) and compute (the same decode step with mlx-lm and the model resident),
4. checks peak memory against the budget, 5. prints a table and writes it into docs/benchmarks.md
between the results markers.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from spill import config
from spill.platform import reexec_with_preload

sys.path.append(str(Path(__file__).resolve().parents[1]))   # last: tests.machine; an installed spill wins
from tests.machine import blas_core  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
GB = 1e9


def model_args(p: argparse.ArgumentParser, size: str) -> None:
    """--models, --family, --size, --seed: the factory model a benchmark builds or reuses (`model_folder`)."""
    p.add_argument("--models", default=config.get("SPILL_TEST_BENCH_MODELS"))
    p.add_argument("--family", default="llama")
    p.add_argument("--size", default=size)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", help="the stored dtype of the weights")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_args(p, "3b")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--passes", type=int, default=4, help="decode passes (and resident steps) per batch, >= 3")
    p.add_argument("--reps", type=int, default=3, help="cold bandwidth repetitions")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="'' to skip writing it")
    p.add_argument("--serial", action=argparse.BooleanOptionalAction, default=True,
                   help="also time batch 8 without read-ahead")
    p.add_argument("--device", choices=["default", "cpu", "gpu"], default="default",
                   help="where MLX computes (cpu: float32; gpu: the stored dtype)")
    return p.parse_args()


# -- 1. the model and the disk ----------------------------------------------------------------------
def model_folder(a) -> Path:
    """Reuse a folder of the same family/size/seed (the factory renames it into place when complete)."""
    from spill.factory import make_model
    dtype = getattr(a, "dtype", "bfloat16")
    out = Path(a.models) / f"{a.family}-{a.size}-{dtype}-seed{a.seed}"
    if not (out / "config.json").is_file():
        print(f"building {out} ...", flush=True)
        make_model(out, family=a.family, size=a.size, seed=a.seed, dtype=dtype, shard_size="2GB")
    return out


def drop_cache(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    try:  # as root, drop the whole page cache too
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError:
        pass


def read_all(files, chunk=64 << 20, drop_behind=True) -> float:
    """GB/s of one sequential read of every file in `chunk`-sized positional reads, from cold."""
    drop_cache(files)
    view, n = memoryview(bytearray(chunk)), 0
    t0 = time.perf_counter()
    for f in files:
        fd, off = os.open(f, os.O_RDONLY), 0
        while got := os.preadv(fd, [view], off):
            if drop_behind:  # as the engine's reader does: what was read leaves the page cache
                os.posix_fadvise(fd, off, got, os.POSIX_FADV_DONTNEED)
            off += got
        os.close(fd)
        n += off
    return n / (time.perf_counter() - t0) / GB


def read_direct(files, threads, chunk=16 << 20) -> float:
    """GB/s of one read of every file from cold with O_DIRECT into huge-page buffers, `chunk` bytes a
    call on `threads` threads at once (the engine's reader, without its layer boundaries)."""
    import queue
    from concurrent.futures import ThreadPoolExecutor
    from spill.streamer.pages import aligned_buffer
    drop_cache(files)
    free = queue.SimpleQueue()
    for _ in range(threads):
        free.put(aligned_buffer(chunk))
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files}
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, chunk)]

    def one(job):
        buf = free.get()
        try:
            return os.preadv(fds[job[0]], [memoryview(buf)], job[1])
        finally:
            free.put(buf)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        n = sum(pool.map(one, jobs))
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return n / dt / GB


def cold_reads(files, reps, into: dict) -> None:
    """Append `reps` cold reads of each way of reading to `into` (way -> GB/s list), alternating."""
    ways = {"page cache, drop-behind, 1 thread, 64 MiB": read_all,
            f"O_DIRECT, huge pages, {config.read_threads()} threads, 16 MiB":
                lambda f: read_direct(f, config.read_threads())}
    for _ in range(reps):
        for name, read in ways.items():
            into.setdefault(name, []).append(read(files))
    print("  cold reads: " + "; ".join(f"{k}: {', '.join(f'{x:.2f}' for x in v)} GB/s" for k, v in into.items()),
          flush=True)


# -- 3. resident compute: mlx-lm, the same prompts, the same dtype ----------------------------------------
def left_pad(prompts):
    import numpy as np
    width = max(map(len, prompts))
    x = np.zeros((len(prompts), width), np.int32)
    for j, p in enumerate(prompts):
        x[j, width - len(p):] = p
    return x, [width - len(p) for p in prompts]


def resident_decode(folder, prompts, batches, steps) -> dict[int, float]:
    """Median seconds of one decode step `model(tokens[B, 1])` per batch, with the model resident."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache
    from mlx_lm.utils import load
    from spill.streamer.core import default_dtype
    model, _ = load(str(folder), lazy=True)
    if default_dtype() is not None:   # the streamer's compute dtype: float32 on the CPU, stored on a GPU
        model.set_dtype(default_dtype())
    mx.eval(model.parameters())
    out = {}
    for b in batches:
        x, pads = left_pad(prompts[:b])
        caches = [BatchKVCache(pads) for _ in model.layers]
        tok = mx.argmax(model(mx.array(x), cache=caches)[:, -1, :], axis=-1)
        mx.eval(tok)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            tok = mx.argmax(model(tok[:, None], cache=caches)[:, -1, :], axis=-1)
            mx.eval(tok)
            times.append(time.perf_counter() - t0)
        out[b] = statistics.median(times)
        print(f"  resident B={b}: decode step {out[b]:.2f} s ({', '.join(f'{t:.2f}' for t in times)})", flush=True)
        del caches, tok
        mx.clear_cache()
    del model
    gc.collect()
    mx.clear_cache()
    return out


# -- 3-4. the streamer: one prefill pass, then decode-only passes -------------------------------------
def cpu_seconds() -> tuple[float, float]:
    """(CPU-s the whole machine spent busy or stolen by the hypervisor, CPU-s this process spent)."""
    tick = os.sysconf("SC_CLK_TCK")
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / tick, (int(own[11]) + int(own[12])) / tick


def rss_hwm_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")   # resets VmHWM (peak resident set) of this process


def rss_hwm() -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def budget(s, b) -> int:
    """The layers' buffers (reader buffers, the layers in flight in the compute dtype, and the largest tensors
    staged in their stored dtype before the cast, one per convert thread) + resident + KV + activations (an estimate: a
    layer's intermediates, attention scores and logits for b rows)."""
    plan, size = s.plan, s.dtype.size if s.dtype is not None else 2
    def cast(t):
        return t.nbytes // 2 * size if t.dtype in ("BF16", "F16") else t.nbytes
    layer = max(sum(cast(t) for t in layer) for layer in plan.layers)
    resident = sum(cast(t) for t in plan.resident)
    kv = sum(c.keys.nbytes + c.values.nbytes for p in s.pools.values() for c in p.caches)
    c = plan.config
    kv_len = max(p.caches[0].keys.shape[2] for p in s.pools.values())
    width = 4 * c["hidden_size"] + 3 * c["intermediate_size"] + c["num_attention_heads"] * kv_len
    act = b * size * (width + c["vocab_size"])
    # each convert thread stages one tensor in its stored dtype before the cast: the largest ones
    sizes = sorted((t.nbytes for layer in plan.layers for t in layer), reverse=True)
    staged = sum(sizes[:s.reader.convert_threads if s.dtype is not None else 1])
    return s.reader.slot_bytes + s.reader.in_flight * layer + staged + resident + kv + act


def stream(folder, files, prompts, b, passes, read_ahead=True) -> dict:
    import mlx.core as mx
    from spill.streamer.core import Row, Streamer
    drop_cache(files)
    s = Streamer(folder, read_ahead=read_ahead)
    try:
        for j in range(b):
            s.add(Row(f"r{j}", prompts[j], max_tokens=passes + 2))
        first = s.step()
        assert first.prefill_tokens > 0 and len(first.emitted) == b, "the first pass should prefill every row"
        rows = []
        for k in range(passes):
            if k == passes - 1:   # peak memory of the last decode pass
                mx.reset_peak_memory()
                rss_hwm_reset()
            r0, c0 = s.reader.stats(), cpu_seconds()
            rep = s.step()
            r1, c1 = s.reader.stats(), cpu_seconds()
            cores = os.cpu_count() * rep.seconds
            assert rep.prefill_tokens == 0 and rep.decode_rows == b and len(rep.emitted) == b
            rows.append({"pass": rep.seconds, "wait": rep.wait_s, "comp": rep.compute_s,
                         "read": r1["read_s"] - r0["read_s"], "conv": r1["convert_s"] - r0["convert_s"],
                         "over": rep.seconds - rep.wait_s - rep.compute_s,
                         "gbps": (r1["bytes_read"] - r0["bytes_read"]) / max(r1["read_s"] - r0["read_s"], 1e-9) / GB,
                         "own": (c1[1] - c0[1]) / cores, "foreign": (c1[0] - c0[0] - (c1[1] - c0[1])) / cores})
        print(f"  stream B={b}{'' if read_ahead else ' no read-ahead'}: prefill pass {first.seconds:.1f} s, decode "
              + ", ".join(f"{r['pass']:.2f}" for r in rows), flush=True)
        out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out.update(peak=rep.peak_memory, hwm=rss_hwm(), buffers=s.reader.buffer_bytes,
                   budget=budget(s, b), streamed=s.plan.streamed_bytes, prefill_s=first.seconds)
        return out
    finally:
        s.close()
        del s
        gc.collect()
        mx.clear_cache()


def reader_settings() -> str:
    from spill.platform import BIG_PRODUCT
    blas = config.blas_threads() or f"chosen each pass (every core from {BIG_PRODUCT} rows, one fewer below)"
    return (f"{config.read_threads()} read threads, {config.convert_threads()} convert threads, "
            f"O_DIRECT {'on' if config.direct_io() else 'off'}, BLAS threads in the engine: {blas}")


# -- 5. the report ------------------------------------------------------------------------------------
def hardware(folder) -> list[str]:
    import mlx.core as mx
    import mlx_lm
    info = dict(map(str.strip, l.split(":", 1)) for l in Path("/proc/cpuinfo").read_text().splitlines() if ":" in l)
    mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    dev = os.stat(folder).st_dev
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    block = block if (block / "queue").exists() else block.parent
    rot = (block / "queue" / "rotational").read_text().strip() if (block / "queue").exists() else "?"
    osr = dict(l.split("=", 1) for l in Path("/etc/os-release").read_text().splitlines() if "=" in l)
    blas = "libopenblas" in Path("/proc/self/maps").read_text()
    gpu = f"; GPU: {mx.device_info().get('device_name', '?')}" if mx.default_device() == mx.gpu else ""  # noqa: E501
    return [f"CPU: {info.get('model name', '?')}, {os.cpu_count()} cores; RAM {mem / 2**30:.1f} GiB{gpu}",
            f"Disk: /dev/{block.name} (queue/rotational={rot}) holding {folder}",
            f"OS: {osr.get('PRETTY_NAME', '?').strip(chr(34))}, kernel {platform.release()}; "
            f"Python {platform.python_version()}",
            f"MLX {mx.__version__}, mlx-lm {mlx_lm.__version__}; "
            f"OpenBLAS preloaded: {f'yes ({blas_core()} kernels)' if blas else 'NO'}"]


def table(results) -> list[str]:
    """Time per decode pass (medians) with the engine's profile, then memory of the last pass."""
    cols = ("batch | bound | pass s | IO s | compute s | pass/max(IO,compute) | wait s | compute s (engine) | read s | "
            "convert s | overhead s | read GB/s in pass | CPU: spill | CPU: others + steal | pass/IO at the best read")
    out = ["| " + cols + " |", "|" + "---|" * (cols.count("|") + 1)]
    for label, r in results:
        out.append(f"| {label} | {'IO' if r['io'] >= r['compute'] else 'compute'} | {r['pass']:.2f} | {r['io']:.2f} | "
                   f"{r['compute']:.2f} | **{r['pass'] / max(r['io'], r['compute']):.2f}** | {r['wait']:.2f} | "
                   f"{r['comp']:.2f} | {r['read']:.2f} | {r['conv']:.2f} | {r['over']:.2f} | {r['gbps']:.2f} | "
                   f"{r['own']:.0%} | {r['foreign']:.0%} | {r['pass'] / max(r['io_best'], r['compute']):.2f} |")
    cols = "batch | MLX peak GB | + reader buffers GB | budget GB | MLX peak + buffers within budget | RSS peak GB"
    out += ["", "| " + cols + " |", "|" + "---|" * (cols.count("|") + 1)]
    for label, r in results:
        total, over = r["peak"] + r["buffers"], r["peak"] + r["buffers"] - r["budget"]
        out.append(f"| {label} | {r['peak'] / GB:.2f} | {total / GB:.2f} | {r['budget'] / GB:.2f} | "
                   f"{'yes' if over <= 0 else f'no, over by {over / 2**20:.0f} MiB'} | {r['hwm'] / GB:.2f} |")
    return out


def write_doc(path, lines) -> None:
    path = Path(path)
    text = path.read_text() if path.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    pre, rest = text.split(BEGIN, 1)
    path.write_text(pre + BEGIN + "\n" + "\n".join(lines) + "\n" + END + rest.split(END, 1)[1])
    print(f"wrote {path}")


def main() -> None:
    a = parse()
    reexec_with_preload(sys.argv)   # OpenBLAS must be loaded before MLX starts: re-exec once with it preloaded
    import mlx.core as mx
    import numpy as np
    if a.device != "default":
        mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    batches = [int(b) for b in a.batches.split(",")]
    assert a.passes >= 3, "--passes must be at least 3"
    started = time.time()
    folder = model_folder(a)
    files = sorted(folder.glob("*.safetensors"))
    print(f"cold read bandwidth of {len(files)} shards ({sum(f.stat().st_size for f in files) / GB:.2f} GB) ...",
          flush=True)
    cold: dict[str, list[float]] = {}
    cold_reads(files, a.reps, cold)
    # short prompts of varied length (token ids drawn from the vocabulary), the same for both sides
    rng = np.random.default_rng(a.seed)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    n = a.prompt_tokens
    prompts = [rng.integers(100, vocab, rng.integers(n - n // 4, n + n // 4 + 1)).tolist() for _ in range(max(batches))]
    print("resident compute (mlx-lm) ...", flush=True)
    compute = resident_decode(folder, prompts, batches, a.passes)
    print("streamed passes ...", flush=True)
    results = []
    runs = [(str(b), b, True) for b in batches]
    if 8 in batches and a.serial:  # what overlapping reads with compute buys
        runs.append(("8, no read-ahead", 8, False))
    for label, b, ra in runs:
        r = stream(folder, files, prompts, b, a.passes, read_ahead=ra)
        r.update(compute=compute[b])
        results.append((label, r))
    print("cold reads again ...", flush=True)
    cold_reads(files, a.reps, cold)
    # the roofline: the faster way of reading's median over the reads before and after the passes
    way, bw = max(((k, statistics.median(v)) for k, v in cold.items()), key=lambda kv: kv[1])
    best = max(x for v in cold.values() for x in v)
    for _, r in results:
        r.update(io=r["streamed"] / (bw * GB), io_best=r["streamed"] / (best * GB))
    streamed = results[0][1]["streamed"]
    lines = [f"Measured {datetime.date.today().isoformat()} by `benchmarks/pass_time.py` "
             f"(--size {a.size} --family {a.family} --batches {a.batches} --passes {a.passes}), "
             f"{(time.time() - started) / 60:.1f} min.", ""]
    lines += [f"- {h}" for h in hardware(folder)]
    lines += [f"- Model: {a.family} {a.size}, {a.dtype} on disk, computed in "   # a CPU computes in float32
              f"{'float32' if mx.default_device() == mx.cpu else a.dtype} on the {mx.default_device()}; "
              f"{sum(f.stat().st_size for f in files) / GB:.2f} GB in {len(files)} shards, "
              f"{streamed / GB:.2f} GB streamed per pass",
              f"- Cold read bandwidth (IO s = bytes streamed per pass / it): **{bw:.2f} GB/s**, the median of "
              f"{way}, the faster way's median; the best single read {best:.2f} GB/s (the last column). "
              f"Reads, {a.reps} before the passes and {a.reps} after: "
              + "; ".join(f"{k}: {', '.join(f'{x:.2f}' for x in v)}" for k, v in cold.items()),
              f"- Reader: {reader_settings()}",
              f"- Prompts {n - n // 4}-{n + n // 4} tokens; one prefill pass, then the median of {a.passes} decode "
              "passes (and resident decode steps)", ""]
    lines += table(results)
    print("\n" + "\n".join(lines))
    if a.doc:
        write_doc(a.doc, lines)


if __name__ == "__main__":
    main()
