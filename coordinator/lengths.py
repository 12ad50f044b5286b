"""A job's rows' real token counts, for its estimate: here (`sim_rows`) or in a child process
(`measured_rows`), which at a model's first use also runs the calibration probes (stored for the
coordinator to read). The estimate imports this module, never the other way round.

The coordinator lives as long as the group; a tokenizer or a probe's model loaded there (transformers,
mlx-lm and the model's tokenizer: 49 MiB on lean45, `benchmarks/group_memory.py`) would stay with it, memory the budget then takes
from the KV cache. The child reads the batch file, tokenizes the rows asked for, calibrates if this
model has no calibration here yet, prints the lengths and exits.
"""

import json
import subprocess
import sys
from pathlib import Path

from spill.admission.simulate import SimRow
from spill.errors import SpillError


def request_dict(r, defaults: dict) -> dict:
    """A row as the tokenizer worker takes it, the job's defaults filled in."""
    temperature = r.temperature if r.temperature is not None else defaults.get("temperature", 0.0)
    return {"kind": r.kind, "messages": r.messages, "prompt": r.prompt,
            "max_tokens": r.max_tokens or defaults.get("max_tokens", 256),
            "temperature": temperature, "top_p": r.top_p, "top_k": r.top_k, "seed": r.seed, "stop": r.stop}


def sim_rows(folder: Path, requests: list, which, defaults: dict) -> tuple[list[SimRow], int]:
    """The rows `which` tokenized for real: (their SimRows, how many cannot run)."""
    from spill.tokenizer_worker.core import TokenizerCore   # loads transformers: after without_torch in a child
    core = TokenizerCore(folder)
    rows, errors, which = [], 0, list(which)
    for k in range(0, len(which), 1024):
        chunk = which[k:k + 1024]
        asked = [request_dict(requests[i], defaults) for i in chunk]
        for i, request, (ids, _why) in zip(chunk, asked, core.tokenize_many(chunk, asked, keep=False)):
            if ids is None:
                errors += 1
            else:
                rows.append(SimRow(i, len(ids), request["max_tokens"]))
    return rows, errors


def measured_rows(folder: Path, input: Path, which, defaults: dict, timeout_s: float = 3600.0) -> tuple[list[SimRow], int]:
    """(SimRows of the rows `which` of `input`, how many of them cannot run), tokenized in a child that
    also leaves the model calibrated."""
    which = sorted(which)
    ask = json.dumps({"folder": str(folder), "input": str(input), "which": which, "defaults": defaults})
    done = subprocess.run([sys.executable, "-m", "spill.coordinator.lengths"], input=ask, capture_output=True,
                          text=True, timeout=timeout_s)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpillError(f"the rows' token counts could not be measured: {tail}")
    out = json.loads(done.stdout)
    return [SimRow(row, prompt, max_tokens) for row, prompt, max_tokens in out["rows"]], out["errors"]


def main() -> None:
    from spill.platform import without_torch
    without_torch()
    from spill.admission.calibration import open_calibration
    from .batch_input import read_batch
    ask = json.loads(sys.stdin.read())
    rows, errors = [], 0
    if ask["which"]:
        requests, _bad = read_batch(Path(ask["input"]))
        rows, errors = sim_rows(Path(ask["folder"]), requests, ask["which"], ask["defaults"])
    open_calibration(Path(ask["folder"]))   # probes at first use
    json.dump({"rows": [[r.row, r.prompt, r.out] for r in rows], "errors": errors}, sys.stdout)


if __name__ == "__main__":
    main()
