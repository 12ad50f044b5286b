"""A job's pass history: one JSON line per pass in its folder (`passes.jsonl`), what `spill report`
plots. Every field the PASS message carries is kept, so fields added to it later come along."""

import json
import time
from dataclasses import asdict
from pathlib import Path

FILE = "passes.jsonl"


def append(job_dir: Path, msg, done: int, eta_s: float | None = None) -> None:
    """Record one pass: its report, the wall time, the rows done so far and the live ETA then (not
    fsynced: a lost line costs a point on a plot, not a result)."""
    line = {**asdict(msg), "finished": len(msg.finished), "finished_rows": list(msg.finished),
            "time": time.time(), "done": done, "eta_s": eta_s}
    with open(Path(job_dir) / FILE, "a") as f:
        f.write(json.dumps(line) + "\n")


def written(job_dir: Path, done: int) -> None:
    """Record the rows written since the last pass's record: a pass counts its rows before their lines are
    written, so without this the last record of a finished job (20/20) said 10 done."""
    with open(Path(job_dir) / FILE, "a") as f:
        f.write(json.dumps({"written": True, "time": time.time(), "done": done}) + "\n")


def read(job_dir: Path) -> list[dict]:
    """The recorded passes, oldest first, each with the rows done once its rows were written; a torn
    last line is skipped."""
    out = []
    try:
        with open(Path(job_dir) / FILE) as f:
            for raw in f:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if not line.get("written"):
                    out.append(line)
                elif out:
                    out[-1]["done"] = max(out[-1]["done"], line["done"])
    except FileNotFoundError:
        pass
    return out
