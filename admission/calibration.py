"""Calibration: one pass model per model | dtype | device | machine, stored under
`$SPILL_HOME/calibration/`, started from a cold read probe and a short compute probe at first use
and refitted from every pass the streamer reports.

The model part of the key is its content (config, weight index, weight file names and sizes),
never its path: a copy of a model shares its numbers, another model never does.
"""

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from spill import config
from spill.streamer.groups import chunk_for

from .passmodel import Observation, PassModel, fit
from .schedule import outstanding, pace

HISTORY = 200                  # passes kept for the refit
PROBE_BYTES = 1 << 30          # the cold read probe reads at most this much of the weights
_CHUNK = 64 << 20
_F_NOCACHE = 48                # macOS fcntl: reads bypass the unified buffer cache


# -- the key --------------------------------------------------------------------------------------
def model_key(folder: str | Path) -> str:
    """A digest of what the model is: config.json, the weight index and every weight file's name
    and size (not the path, not the bytes: hashing gigabytes would cost a full read)."""
    folder = Path(folder)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        p = folder / name
        h.update(name.encode() + b"\0" + (p.read_bytes() if p.is_file() else b"") + b"\0")
    for p in sorted(folder.glob("*.safetensors")):
        h.update(f"{p.name}\0{p.stat().st_size}\0".encode())
    return h.hexdigest()[:20]


def device_key() -> str:
    import mlx.core as mx
    dev = mx.default_device()
    if dev == mx.cpu:
        return "cpu"
    try:
        name = mx.device_info().get("device_name", "gpu")
    except Exception:   # an MLX without device_info: the kind is still a key
        name = "gpu"
    return f"gpu-{name}"


def machine_key() -> str:
    """Host name, architecture, CPU model and memory size: a rate measured here applies here."""
    cpu = platform.processor()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    raw = f"{platform.node()}|{platform.machine()}|{cpu}|{mem}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def key(folder: str | Path, dtype: str) -> str:
    return "|".join((model_key(folder), dtype, device_key(), machine_key()))


def store_path(k: str) -> Path:
    return config.home() / "calibration" / (k.replace("|", "__").replace(" ", "_") + ".json")


# -- the probes -----------------------------------------------------------------------------------
def weight_files(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def read_probe(files: list[Path], limit: int = PROBE_BYTES) -> float:
    """Cold sequential read bandwidth in bytes/s: each file's pages are dropped from the page cache
    first and behind every read (as the streamer's reader does), so a model that was just read
    cannot pose as a streaming rate."""
    buf = bytearray(_CHUNK)
    done, seconds = 0, 0.0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            _drop(fd, 0, 0)
            if sys.platform == "darwin":
                import fcntl
                fcntl.fcntl(fd, _F_NOCACHE, 1)
            pos, t0 = 0, time.perf_counter()
            while done < limit:
                n = os.preadv(fd, [memoryview(buf)[:min(_CHUNK, limit - done)]], pos)
                if n <= 0:
                    break
                _drop(fd, pos, n)
                pos, done = pos + n, done + n
            seconds += time.perf_counter() - t0
        finally:
            os.close(fd)
        if done >= limit:
            break
    return done / seconds if seconds > 0 else float("inf")


def _drop(fd: int, offset: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def compute_probe(plan, dtype) -> PassModel:
    """Time the model's first layer as the streamer runs it (its weights, its attention, in the
    compute dtype): a 128-token prefill, then decode steps of 1, 2 and 16 rows, scaled to every
    layer; the head per row and attention per token of context priced from a matmul of the
    model's width; what 2 rows cost beyond one (a CPU packs weights for a product) is its own term.
    A layer that cannot run here leaves the matmul's figures alone."""
    import mlx.core as mx
    c = plan.config
    h, n = int(c.get("hidden_size", 1024)), int(c.get("num_hidden_layers", 1))
    fixed_per_param, row_per_param = _matmul_rates(h, dtype)
    params = plan.streamed_bytes / {"BF16": 2, "F16": 2, "F32": 4}.get(_stored_dtype(plan), 2)
    head = row_per_param * h * int(c.get("vocab_size", 0))
    model = PassModel(bandwidth=1.0, fixed_s=fixed_per_param * params, per_row_s=row_per_param * params + head,
                      per_prefill_token_s=row_per_param * params, per_context_token_s=row_per_param * 2 * h * n)
    try:
        from spill.streamer.families import adapter_for
        from spill.streamer.reader import WeightReader
        adapter = adapter_for(plan)
        with WeightReader(plan, dtype=dtype, read_ahead=False) as reader:
            reader.start_pass([0])
            adapter.load_layer(0, reader.take(0))
        layer = adapter.layers[0]

        def run(rows: int, tokens: int, caches) -> float:
            x = mx.random.normal((rows, tokens, h)).astype(dtype)
            mask = adapter.masks(x, caches)[0]
            mx.eval(x)
            t0 = time.perf_counter()
            mx.eval(layer(x, mask, cache=caches[0]))
            return time.perf_counter() - t0

        caches = lambda b: [adapter.make_cache(i, [0] * b) for i in range(len(adapter.layers))]
        prefill = min(run(1, 128, caches(1)) for _ in range(3))      # the first run also warms up
        one, two, many = caches(1), caches(2), caches(16)
        run(1, 128, one)
        run(2, 32, two)
        run(16, 32, many)
        d1, d2, d16 = (min(run(b, 1, c) for _ in range(3)) for b, c in ((1, one), (2, two), (16, many)))
        row = max(d16 - d2, 0.0) / 14
        packed = max(d2 - d1 - row, 0.0)      # one row is a matrix-vector product; more, a packed product
        model.fixed_s, model.packed_s = d1 * n, packed * n
        model.per_row_s = row * n + head
        model.per_prefill_token_s = max(prefill - d1 - packed, 0.0) / 128 * n
    except Exception:   # an exotic layer: the matmul's figures stay the prior
        pass
    return model


PROBE_ROWS = 16   # the pass probe's decode batch


def pass_probe(folder, dtype) -> list[Observation]:
    """Real passes of the streamer, the weights dropped from the page cache first: 16 short prompts
    prefilled together, two decode steps of all 16 (the first warms up: on the demo model it cost 2.5x
    the second), then one of a single row; all but the warm-up returned. They hold what a pass costs
    beyond its layers' math (loading each layer, the head and sampling, products over weights just read)."""
    from spill.streamer.core import Row, Streamer
    for path in weight_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            _drop(fd, 0, 0)
        finally:
            os.close(fd)
    streamer = Streamer(folder, dtype=dtype, prefill_chunk=64)
    try:
        for i in range(PROBE_ROWS):   # row 0, in the first slot, outlives the others: it decodes alone
            streamer.add(Row(i, list(range(1 + i, 17 + i)), 4 if i == 0 else 3))
        out = []
        for rows, context in ((0, 0), (PROBE_ROWS, PROBE_ROWS * 17), (PROBE_ROWS, PROBE_ROWS * 18), (1, 19)):
            r = streamer.step()
            out.append(Observation(rows, r.prefill_tokens, context, r.bytes_streamed, r.seconds, r.wait_s,
                                   r.compute_s, r.read_s))
        return [out[0], *out[2:]]
    finally:
        streamer.close()


def priced_by_passes(model: PassModel, passes: list[Observation]) -> PassModel:
    """The layer probe's model with its compute terms from `pass_probe`'s passes (fixed from the lone row's,
    per row from the 16 rows' beyond it, prefill tokens from the rest of the first), their overlap and overhead."""
    prefill, many, one = passes
    ctx = model.per_context_token_s
    fixed = max(one.compute_s - ctx * one.context_tokens, 1e-6)
    row = max(many.compute_s - one.compute_s - ctx * (many.context_tokens - one.context_tokens), 0.0) / (
        many.decode_rows - one.decode_rows)
    overhead = float(np.median([max(p.seconds - p.wait_s - p.compute_s, 0.0) for p in passes]))
    hidden = [1.0 - (p.seconds - overhead - max(p.read_s, p.compute_s)) / min(p.read_s, p.compute_s)
              for p in passes if min(p.read_s, p.compute_s) > 0]
    return PassModel(model.bandwidth, fixed, 0.0, row, max(prefill.compute_s - fixed, 0.0) / max(prefill.prefill_tokens, 1),
                     ctx, overlap=float(np.clip(np.median(hidden), 0.0, 1.0)) if hidden else model.overlap,
                     overhead_s=overhead)


def _matmul_rates(h: int, dtype) -> tuple[float, float]:
    """Seconds per weight of an [h, h] matmul in `dtype`: for one row (the weights' trip through
    memory) and for each further row of a 256-row batch."""
    import mlx.core as mx
    w = mx.random.normal((h, h)).astype(dtype)
    one, many = mx.random.normal((1, h)).astype(dtype), mx.random.normal((256, h)).astype(dtype)
    mx.eval(w, one, many)

    def timed(x, reps=5) -> float:
        mx.eval(x @ w.T)
        t0 = time.perf_counter()
        for _ in range(reps):
            mx.eval(x @ w.T)
        return (time.perf_counter() - t0) / reps

    t1, t256 = timed(one), timed(many)
    return t1 / (h * h), max(t256 - t1, 1e-9) / 255 / (h * h)


# -- the store and the refit ----------------------------------------------------------------------
class Calibration:
    """The stored numbers of one key: the probe's prior, the passes seen, the refitted model."""

    def __init__(self, k: str, prior: PassModel, passes: list[Observation] | None = None,
                 seen: int = 0, name: str = ""):
        self.key, self.prior, self.name = k, prior, name
        self.streamed_bytes = 0                   # set by open_calibration from the model's plan
        self.passes = list(passes or [])[-HISTORY:]
        self.seen = seen                          # passes observed in all, kept or not
        self.model = fit(prior, self.passes)

    def observe(self, obs: Observation) -> None:
        self.passes = (self.passes + [obs])[-HISTORY:]
        self.seen += 1
        self.model = fit(self.prior, self.passes)

    def save(self) -> None:
        path = store_path(self.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"key": self.key, "model_name": self.name, "seen": self.seen, "prior": self.prior.to_dict(),
                "fitted": self.model.to_dict(), "passes": [asdict(p) for p in self.passes]}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    @classmethod
    def load(cls, k: str) -> "Calibration | None":
        """The stored calibration of exactly this key, or None (missing, unreadable or another key)."""
        try:
            data = json.loads(store_path(k).read_text())
            if data.get("key") != k:
                return None
            return cls(k, PassModel(**data["prior"]), [Observation(**p) for p in data["passes"]],
                       int(data.get("seen", 0)), data.get("model_name", ""))
        except (OSError, ValueError, TypeError, KeyError):
            return None


def open_calibration(folder: str | Path, dtype=None) -> Calibration:
    """The calibration of this model on this machine, probing and storing it at first use.
    `dtype` is the compute dtype (default: the streamer's for this device)."""
    import mlx.core as mx
    from spill.streamer.plan import load_plan
    plan = load_plan(folder)
    k, dtype = _key_of(folder, plan, dtype)
    cal = Calibration.load(k)
    if cal is None:
        prior, passes = compute_probe(plan, dtype or mx.bfloat16), []
        try:
            passes = pass_probe(folder, dtype)
            prior = priced_by_passes(prior, passes)
        except Exception:   # a model the streamer cannot run: the layer probe's figures stay
            pass
        mx.clear_cache()   # the probes' freed buffers: not kept for the life of the process that probed
        prior.bandwidth = read_probe(weight_files(folder))
        # reads inside passes run slower than alone (lean45 on 2 vCPUs: 0.65-0.8 GB/s against 1.16);
        # a pass of under 256 MiB times its calls, not the disk
        inside = [p.bytes_streamed / p.read_s for p in passes if p.read_s > 0 and p.bytes_streamed >= 1 << 28]
        if inside:
            prior.bandwidth = min(prior.bandwidth, float(np.median(inside)))
        cal = Calibration(k, prior, name=Path(folder).name)
        cal.save()
    cal.streamed_bytes = plan.streamed_bytes
    return cal


def stored_calibration(folder: str | Path) -> Calibration | None:
    """The calibration of this model on this machine if one was made; never probes."""
    from spill.streamer.plan import load_plan
    return Calibration.load(_key_of(folder, load_plan(folder), None)[0])


def _stored_dtype(plan) -> str:
    return plan.layers[0][0].dtype if plan.layers and plan.layers[0] else "F32"


def _key_of(folder, plan, dtype) -> tuple[str, object]:
    from spill.platform import default_dtype
    dtype = dtype or default_dtype()
    name = str(dtype).replace("mlx.core.", "") if dtype is not None else f"stored-{_stored_dtype(plan)}"
    return key(folder, name), dtype


class ContextTracker:
    """The rows that decode in a pass and the context they attend to, which the PASS report does not
    carry: each admitted row prefills its share of the pass's prompt tokens (`budget`, as the streamer
    shares them out), then decodes with one more token of context each pass."""

    def __init__(self, chunk: int = 512):
        self.chunk = chunk
        self.budget = config.prefill_tokens()     # the last PACE: what the next pass may prefill
        self.prefilling: dict[int, list[int]] = {}   # row -> [prompt tokens left, prompt length]
        self.decoding: dict[int, int] = {}           # row -> context

    def admitted(self, rows: list[int], lengths: list[int]) -> None:
        self.prefilling.update((r, [n, n]) for r, n in zip(rows, lengths))

    def passed(self, finished: list[int]) -> tuple[int, int]:
        """(decoding rows, their context) of the pass just reported; then each grows by one token."""
        rows, context = len(self.decoding), sum(self.decoding.values())
        for r in self.decoding:
            self.decoding[r] += 1
        step = chunk_for(self.budget, len(self.prefilling), self.chunk)
        for r, state in list(self.prefilling.items()):
            state[0] -= min(step, state[0])
            if state[0] == 0:
                self.decoding[r] = state[1] + 1
                del self.prefilling[r]
        for r in finished:
            self.decoding.pop(r, None)
            self.prefilling.pop(r, None)
        return rows, context

    def clear(self) -> None:
        self.prefilling, self.decoding, self.budget = {}, {}, config.prefill_tokens()


class Calibrator:
    """The admission actor's hook: opens the model's calibration on a reset, refits and stores it
    after every pass. A calibration that cannot be made is logged and skipped, never fatal."""

    def __init__(self, log, chunk: int = 512):
        self.log = log
        self.model = ""
        self.cal: Calibration | None = None
        self.streamed = 0                      # bytes a pass streams
        self.context = ContextTracker(chunk)

    def reset(self, model: str, resident: bool = False) -> None:
        """A new epoch; `resident`: passes read nothing, so no read time bounds a pass's prefill."""
        self.context.clear()
        if model and model != self.model:
            self.model, self.cal = model, None
            try:
                self.cal = open_calibration(model)
                self.log.info("calibration", key=self.cal.key, passes=self.cal.seen, **self.cal.model.to_dict())
            except Exception as err:   # the streamer reports a model that cannot load; here it only costs the estimate
                self.log.warning("calibration_failed", model=model, error=str(err))
        if model:
            self.streamed = 0 if resident or self.cal is None else self.cal.streamed_bytes

    def admitted(self, rows: list[int], lengths: list[int]) -> None:
        self.context.admitted(rows, lengths)

    def probe_bandwidth(self) -> float:
        """The cold read probe's bytes/s for this model and machine, 0.0 without a calibration."""
        return self.cal.prior.bandwidth if self.cal is not None else 0.0

    def pace(self, need: int) -> int:
        """Prompt tokens the next pass may prefill in all (schedule.pace); `need`: what keeps the slots fed."""
        t = self.context
        t.budget = pace(self.cal.model if self.cal else None, self.streamed, len(t.decoding),
                        sum(t.decoding.values()), need)
        return t.budget

    def allowance(self) -> int:
        """Prompt tokens new rows may start with in the next pass: the pace less the rows still prefilling."""
        t = self.context
        return t.budget - outstanding([left for left, _ in t.prefilling.values()], t.budget, t.chunk)

    def passed(self, msg) -> None:
        rows, context = self.context.passed(msg.finished)   # the rows that decoded in it, not after it
        if self.cal is not None:   # a resident pass reads nothing, yet prices compute and overhead
            self.cal.observe(Observation(rows, msg.prefill_tokens, context, msg.bytes_streamed,
                                         msg.seconds, msg.wait_s, msg.compute_s, msg.read_s))
            self.cal.save()
