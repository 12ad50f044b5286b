"""The draft model's price (--draft): what its steps add to a drafting pass, timed at its first use here by running
the streamer's own `DraftModel` (`probe`) and stored per draft model | dtype | device | machine under
`$SPILL_HOME/calibration/drafts/`. Pure but for the probe.

    a drafting pass  += base_s + base_row_s x n + k x (step_s + step_row_s x n) + prompt_token_s x new
    (n: its drafting rows; k: the most drafts one carries, the steps every row takes; new: the tokens of the rows
    drafting for the first time, which the draft model takes in before its steps)

The reader reads at most two layers ahead while the drafts are made, so their time adds to the pass's. A probe, not
a job's passes: the estimate before the first `--draft` job needs the price, and a pass's excess over its plain
price mixes the draft's time with verification's.
"""

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spill import config
from spill.files import replaced
from spill.platform import default_dtype, on_cpu

from .calibration import WIDER, key, model_key
from .probes import PROBE_ROWS, probe_batch

PROMPT = 4        # prompt tokens of each probe row (a 4-bit draft took 0.13 s a token on two CPU cores)
LONG = 64         # the prompt a row the draft model has not seen brings, timed apart
STEPS = 4         # the most drafts a row carries in the probe's steps


@dataclass
class DraftCost:
    base_s: float = 0.0           # a drafting pass's cutting, merging and splitting of the rows' caches
    base_row_s: float = 0.0
    step_s: float = 0.0           # one step of the draft model over every drafting row
    step_row_s: float = 0.0
    prompt_token_s: float = 0.0   # a token the draft model takes in before it drafts for a row

    def seconds(self, rows: int, steps: int, new: int = 0) -> float:
        """What `rows` rows drafting up to `steps` each add to a pass, `new` tokens taken in first."""
        if rows <= 0 or steps <= 0:
            return 0.0
        return (self.base_s + self.base_row_s * rows + steps * (self.step_s + self.step_row_s * rows)
                + self.prompt_token_s * new)


def fit(timings, prompt_token_s: float = 0.0) -> DraftCost:
    """The cost from (rows, steps, seconds) timings: least squares on 1, rows, steps and steps x rows, no term below 0."""
    t = np.array(timings, dtype=float).reshape(-1, 3)
    x = np.column_stack([np.ones(len(t)), t[:, 0], t[:, 1], t[:, 0] * t[:, 1]])
    free = np.ones(4, dtype=bool)
    w = np.zeros(4)
    while free.any():   # a term fitted below zero is dropped, the rest refitted
        w[:] = 0.0
        w[free] = np.linalg.lstsq(x[:, free], t[:, 2], rcond=None)[0]
        if (w >= 0).all():
            break
        free &= w > 0
    return DraftCost(*w.tolist(), prompt_token_s=max(float(prompt_token_s), 0.0))


def draft_key(folder: str | Path) -> str:
    """The draft model in the streamer's dtype here (it runs in the target's compute dtype: float32 on a CPU)."""
    return key(folder, "float32" if on_cpu() else "stored")


def store_path(k: str) -> Path:
    return config.home() / "calibration" / "drafts" / (k.replace("|", "__").replace(" ", "_") + ".json")


def stored_drafter(folder: str | Path) -> DraftCost | None:
    """The draft model's stored price here, or None (never timed, or unreadable); never probes."""
    try:
        data = json.loads(store_path(draft_key(folder)).read_text())
        return fit(data["timings"], data["prompt_token_s"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def open_drafter(folder: str | Path, rows: int = 0, probe_it: bool = True) -> DraftCost | None:
    """The draft model's price here, probed at its first use and again where the job's batch (`rows`) is past WIDER x
    the widest probed (unless not `probe_it`); None where it cannot be timed (the streamer says why it cannot load)."""
    path = store_path(draft_key(folder))
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    widest = max((n for n, _, _ in data["timings"]), default=0) if data else 0
    batch = probe_batch(rows) if rows else PROBE_ROWS
    if probe_it and (data is None or batch > WIDER * widest):
        try:
            timings, per_token = probe(folder, batch)
        except Exception:   # noqa: BLE001 - a draft mlx-lm cannot load: the streamer fails the job with its sentence
            return stored_drafter(folder)
        data = {"key": draft_key(folder), "model": model_key(folder), "prompt_token_s": per_token,
                "timings": (data["timings"] if data else []) + timings}
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced(path) as tmp:
            tmp.write_text(json.dumps(data))
    return fit(data["timings"], data["prompt_token_s"]) if data else None


def probe(folder: str | Path, rows: int) -> tuple[list[list[float]], float]:
    """Time the streamer's DraftModel here: `rows` rows of PROMPT tokens taken in (a warm-up), then their drafting
    passes at (rows, STEPS), (rows, 1), (1, STEPS) and (1, 1), each after two more tokens a row (one kept, one new),
    and a row of LONG prompt tokens taken in. Returns ([rows, steps, seconds] each, seconds a prompt token)."""
    import mlx.core as mx
    from spill.streamer.draft import DraftModel
    from spill.streamer.groups import RowState
    from spill.streamer.records import Row
    from spill.streamer.sampling import RowSampler, SamplingParams
    model = DraftModel(folder, default_dtype(), None)

    def row(i: int, n: int) -> RowState:
        return RowState(Row(i, [(7 * i + j) % 97 + 3 for j in range(n)], 1 << 20), RowSampler(SamplingParams(), 0))

    states = [row(i, PROMPT) for i in range(rows)]
    live = {r.row.id for r in states} | {-1}
    out = model.propose([(r, 1) for r in states], live)

    def timed(wanted) -> float:
        t0 = time.perf_counter()
        drafts = model.propose(wanted, live)
        seconds = time.perf_counter() - t0
        for r, _ in wanted:   # the row keeps its first draft and samples one more
            r.tokens += [drafts[id(r)][0], 5]
        return seconds

    for r in states:
        r.tokens += [out[id(r)][0], 5]
    timings = [[n, k, timed([(r, k) for r in states[:n]])] for n, k in ((rows, STEPS), (rows, 1), (1, STEPS), (1, 1))]
    one = min(t for n, k, t in timings if (n, k) == (1, 1))
    seconds = timed([(row(-1, LONG), 1)])
    mx.clear_cache()
    return timings, max(seconds - one, 0.0) / (LONG - 2)

