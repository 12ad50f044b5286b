"""`spill estimate MODEL INPUT`: every row tokenized for real (the tokenizer worker's core), then the
admission policy and this machine's calibrated pass model simulated pass by pass (admission/simulate.py).
Rows that cannot run (bad lines, prompts that do not fit) are counted as errors, not priced."""

from pathlib import Path

from spill.admission import schedule
from spill.admission.calibration import open_calibration
from spill.admission.simulate import Estimate, SimRow, simulate
from spill.streamer.plan import load_plan
from spill.tokenizer_worker.core import TokenizerCore

from .batch_input import read_batch
from .models import resolve


def request_dict(r, defaults: dict) -> dict:
    """A row as the tokenizer worker takes it, the job's defaults filled in."""
    temperature = r.temperature if r.temperature is not None else defaults.get("temperature", 0.0)
    return {"kind": r.kind, "messages": r.messages, "prompt": r.prompt,
            "max_tokens": r.max_tokens or defaults.get("max_tokens", 256),
            "temperature": temperature, "top_p": r.top_p, "top_k": r.top_k, "seed": r.seed, "stop": r.stop}


def estimate_file(model: str, input: Path, *, max_tokens: int = 256, memory: str | None = None) -> tuple[Estimate, dict]:
    """(the estimate, the calibration it used) for a batch file as `spill run` would run it."""
    folder = resolve(model)
    requests, bad = read_batch(Path(input))
    core = TokenizerCore(folder)
    rows, errors = [], len(bad)
    for i, r in enumerate(requests):
        ids, _why = core.tokenize(i, request_dict(r, {"max_tokens": max_tokens}))
        if ids is None:
            errors += 1
        else:
            rows.append(SimRow(i, len(ids), r.max_tokens or max_tokens))
    core.clear()
    return estimate_rows(folder, rows, errors=errors, memory=memory)


def estimate_rows(folder: Path, rows: list[SimRow], *, errors: int = 0, memory: str | None = None) -> tuple[Estimate, dict]:
    plan = load_plan(folder)
    cal = open_calibration(folder)
    policy, waiting, max_batch = schedule.policy_for(plan, memory, cal.model)
    est = simulate(rows, policy, waiting, cal.model, plan.streamed_bytes, max_batch=max_batch, errors=errors)
    return est, {"key": cal.key, "passes": cal.seen, **cal.model.to_dict()}


def duration(seconds: float) -> str:
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def estimate_line(est: Estimate) -> str:
    """The one line `spill run` prints before its first pass."""
    ratio = est.total_seconds / est.ideal_seconds if est.ideal_seconds else float("nan")
    return (f"estimate: {duration(est.total_seconds)} in {est.passes} passes "
            f"(ideal {duration(est.ideal_seconds)}, {ratio:.2f}x)")


def format_estimate(est: Estimate, calibration: dict) -> str:
    lines = [estimate_line(est),
             f"calibration: {calibration['bandwidth'] / 1e9:.2f} GB/s read, overlap {calibration['overlap']:.2f}, "
             f"refitted from {calibration['passes']} passes",
             f"{'tier':<16}{'rows':>7}{'prompt tok':>12}{'batch':>7}{'passes':>8}{'time':>10}{'ideal':>10}"]
    for t in est.tiers:
        lines.append(f"{t.name:<16}{t.rows:>7}{t.prompt_tokens:>12,}{t.batch:>7.1f}{t.passes:>8}"
                     f"{duration(t.seconds):>10}{duration(t.ideal_seconds):>10}")
    if est.errors:
        lines.append(f"{est.errors} rows cannot run: counted as errors, not priced")
    if est.at_max_tokens:
        lines.append("output lengths are unknown before the run: every row is priced at its max_tokens")
    if est.stalled:
        lines.append("some rows never fit the memory budget with nothing else running: they are not priced")
    return "\n".join(lines)
