"""The estimate's child process: a submitted job's estimate (estimate.py job_estimate) made apart from the
coordinator, which lives as long as the group: a tokenizer or a probe's model loaded there (transformers,
mlx-lm and the model's tokenizer: 49 MiB on lean45) would stay with it, memory the budget then takes from the
KV cache. The child reads what to estimate from FOLDER/ask.json, counts the rows' tokens, calibrates the model
if it has no calibration here yet, prices the job and writes FOLDER/out.json (estimating.work's outcome).

    python -m spill.coordinator.lengths FOLDER
"""

import json
import os
import sys
import threading
import time
from pathlib import Path


def _exit_when_orphaned(parent: int) -> None:
    """A coordinator killed outright leaves no probe running on: its child exits once it is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main() -> None:
    from spill.platform import use_device, without_torch
    without_torch()
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    from .estimating import work
    folder = Path(sys.argv[1])
    ask = json.loads((folder / "ask.json").read_text())
    use_device(ask.get("device"))   # as the coordinator learnt it: this child loads MLX only to compute
    outcome = work(ask)
    tmp = folder / "out.json.tmp"
    tmp.write_text(json.dumps(outcome))
    tmp.rename(folder / "out.json")   # whole or absent: a child killed while writing leaves no half of it


if __name__ == "__main__":
    main()
