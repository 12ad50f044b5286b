"""What a first use spends time on, said while it happens: making the demo model, calibrating a model on
this machine. On a terminal a spinner counts the seconds; piped, one line before and one after. On stderr,
so `--json` and piped results stay clean."""

import sys
import time
from contextlib import contextmanager
from pathlib import Path

from spill import config

PROBE_READS = 6          # the read probe and the pass probe's passes each read the weights about once
PROBE_TOKENS = 10_000    # tokens the layer probe pushes through one layer (prompts of up to 1,024, decode steps)
PROBE_SETUP_S = 8.0      # loading, warming up and many small timed calls, whatever the size (the demo: 10 s)
PASS_TOKENS = 19         # tokens a row of the pass probe pushes through every layer (a 16-token prompt, decode steps)


@contextmanager
def working(what: str, done: str | None):
    """Say `what` now, show the seconds going by, and `done` with the seconds it took at the end (unless it is
    None, or the block sets the dict it is given's "done" to None: it did not get done)."""
    started, said = time.monotonic(), {"done": done}
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=True) as progress:
            progress.add_task(what, total=None)
            yield said
    else:
        print(what, file=sys.stderr, flush=True)
        yield said
    if said["done"]:
        print(f"{said['done']} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)


def demo_folder() -> Path:
    return config.home() / "models" / "demo"


def make_demo() -> None:
    """The demo model, made here with a word on the screen when it is not made yet (12-18 s were silent)."""
    if (demo_folder() / "config.json").exists():
        return
    from .models import resolve
    with working("first use: making the demo model (a few seconds)", f"made the demo model in {demo_folder()}"):
        resolve("demo")


def calibrated(folder: Path, kv: tuple | None = None) -> bool:
    """This model was calibrated on this machine (in some compute dtype, at this KV format): asked without loading MLX."""
    from spill.admission.calibration import machine_key, model_key, store_path
    try:
        found = store_path(model_key(folder)).parent.glob(f"{model_key(folder)}__*__{machine_key()}.json")
        return any(p.name.split("__")[1].endswith(f"-kv{kv[0]}g{kv[1]}") if kv else "-kv" not in p.name
                   for p in found)
    except Exception:   # noqa: BLE001 - a model that does not load: the job or the estimate says why
        return True


def calibration_seconds(folder: Path, rows: int = 0) -> float:
    """A rough figure for the first-use probes: the weights read a few times at 1 GB/s, and their products
    at the rate one matmul of the model's width runs here (`rows`: the job's batch, the pass probe's widest)."""
    from spill.admission.probes import probe_batch
    import mlx.core as mx
    from spill.platform import default_dtype
    from spill.streamer.plan import load_plan
    plan = load_plan(folder)
    h, layers = int(plan.config.get("hidden_size", 1024)), int(plan.config.get("num_hidden_layers", 1))
    dtype = default_dtype() or mx.float32
    w, x = mx.zeros((h, h), dtype=dtype), mx.zeros((256, h), dtype=dtype)
    mx.eval(w, x, x @ w)
    t0 = time.perf_counter()
    mx.eval(x @ w)
    flops_per_s = 2 * 256 * h * h / max(time.perf_counter() - t0, 1e-9)
    params = plan.streamed_bytes / 2
    flops = 2 * params * (PROBE_TOKENS / layers + PASS_TOKENS * probe_batch(rows))
    return PROBE_SETUP_S + PROBE_READS * plan.streamed_bytes / 1e9 + flops / flops_per_s


def calibrating(folder: Path, seconds: float | None = None):
    """working() for a model's first-use probes."""
    about = f": ~{seconds:.0f} s" if seconds is not None else " (first use)"
    return working(f"calibrating this model on this machine{about}", f"calibrated {folder.name} on this machine")


def calibrate(folder: Path, kv: tuple | None = None, rows: int = 0) -> None:
    """`spill estimate`'s first use of a model (at a KV format) here: the probes run with a word on the screen;
    `rows`: the batch the job's budget runs, which the pass probe times (open_calibration)."""
    from spill.admission.calibration import open_calibration
    from .preflight import check_tokenizer
    check_tokenizer(folder)
    if not calibrated(folder, kv):
        with calibrating(folder, calibration_seconds(folder, rows)):
            open_calibration(folder, kv=kv, rows=rows)
    else:
        open_calibration(folder, kv=kv, rows=rows)


def calibrate_draft(folder: Path, rows: int = 0) -> None:
    """`spill estimate --draft`'s first use of a draft model here: its steps timed (drafter.open_drafter) with a word on
    the screen; `rows`: the job's batch."""
    from spill.admission.drafter import open_drafter, stored_drafter
    if stored_drafter(folder) is None:
        with working(f"timing the draft model {folder.name} on this machine (first use)", "timed the draft model"):
            open_drafter(folder, rows)
    else:
        open_drafter(folder, rows)


def local_folder(model: str) -> Path | None:
    """The folder of a MODEL `spill run` has checked (a path, or demo); None for a tag or an id the group resolves."""
    if model == "demo":
        return demo_folder()
    return Path(model) if model and Path(model).is_dir() else None
