"""`spill check`'s teacher-forced gate on tiny models, repeated under each reader setting: how often a
GPU's streamed logits stray from mlx-lm's (the GPU test of tests/streamer/test_check.py failed now and then).

    python benchmarks/check_repeat.py [--reps 6] [--families llama,qwen2,mistral] [--settings default,...]

A setting is `default` or NAME=VALUE,... of the reader's environment (spill/config.py), read when each
check builds its reader. One JSON line per check: setting, family, passed, the largest |delta logit|.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

SETTINGS = "default;SPILL_READ_INTO=buffers"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--families", default="llama,qwen2,mistral")
    p.add_argument("--settings", default=SETTINGS, help="';'-separated settings")
    p.add_argument("--json", help="also write the lines here")
    a = p.parse_args()
    from spill.factory import make_model
    from spill.streamer.check import run_check
    root = Path(tempfile.mkdtemp(prefix="check-repeat-"))
    models = {f: make_model(root / f, family=f, size="tiny", seed=0, dtype="bfloat16") for f in a.families.split(",")}
    lines, base = [], dict(os.environ)
    for setting in a.settings.split(";"):
        os.environ.clear()
        os.environ.update(base)
        if setting != "default":
            os.environ.update(kv.split("=", 1) for kv in setting.split(","))
        for rep in range(a.reps):
            for family, folder in models.items():
                t0 = time.perf_counter()
                r = run_check(folder, n=6, max_tokens=6, prefill_chunk=16)
                worst = max(x.max_logit_diff for x in r.rows)
                lines.append({"setting": setting, "rep": rep, "family": family, "passed": r.passed,
                              "max_logit_diff": round(float(worst), 4), "tolerance": round(float(r.tolerance), 4),
                              "dtype": r.dtype, "device": r.device, "s": round(time.perf_counter() - t0, 1)})
                print(json.dumps(lines[-1]), flush=True)
        bad = sum(not x["passed"] for x in lines if x["setting"] == setting)
        print(f"== {setting}: {bad} of {a.reps * len(models)} checks failed", flush=True)
    if a.json:
        Path(a.json).write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()
