"""What each of the group's processes holds, and what MLX's first steps cost a process's memory.

    python benchmarks/group_memory.py MODEL INPUT [--json FILE]

First, in fresh interpreters, the resident memory (anonymous and file pages) after each step a
process may take with MLX: import, asking the default device, device_info, a small array, a matmul;
then the same with the CPU made the default device first.
Then `spill up --model MODEL`, `spill run MODEL INPUT` on it, and each actor's memory from /proc
while the group is up, with what admission priced as the other processes (its `budget` log line).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from spill import config

STEPS = ["import mlx.core as mx", "mx.default_device()", "mx.device_info()",
         "mx.eval(mx.zeros((4,)))", "mx.eval(mx.ones((256, 256)) @ mx.ones((256, 256)))"]
ON_CPU = ["import mlx.core as mx", "mx.set_default_device(mx.cpu)", "mx.eval(mx.zeros((4,)))",
          "mx.eval(mx.ones((256, 256)) @ mx.ones((256, 256)))"]


def status_kb(pid: int) -> dict:
    keys = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: int(v.split()[0]) * 1024 for k, v in (ln.split(":", 1) for ln in lines) if k in keys}


def steps(seq: list[str]) -> list[dict]:
    """Each step in a fresh interpreter that took every step before it."""
    out = []
    for n in range(1, len(seq) + 1):
        code = "; ".join(seq[:n]) + "; import json, os; " \
               "print(json.dumps(dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines()" \
               " if l.startswith(('VmRSS', 'RssAnon', 'RssFile')))))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        fields = json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-300:]}
        out.append({"step": seq[n - 1], **{k: v.strip() for k, v in fields.items()}})
        print(json.dumps(out[-1]))
    return out


def actors() -> dict:
    """Resident memory of each actor now, found by the pids `spill status` names."""
    words = subprocess.run(["spill", "status"], capture_output=True, text=True, check=True).stdout.split("\n")[0].split()
    pids = {words[i - 1]: int(words[i + 1]) for i, w in enumerate(words) if w == "pid"}   # "ROLE pid N"
    return {f"{role}:{pid}": status_kb(pid) for role, pid in pids.items()}


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("model")
    a.add_argument("input")
    a.add_argument("--json")
    a.add_argument("--memory", default=None)
    args = a.parse_args()
    result = {"steps": steps(STEPS), "on_cpu": steps(ON_CPU)}
    info = subprocess.run([sys.executable, "-c", "import mlx.core as mx; print(mx.device_info())"],
                          capture_output=True, text=True)
    print("device_info:", info.stdout.strip() or info.stderr[-300:])
    up = ["spill", "up", "--model", args.model, "--metrics-port", "0"] + (["--memory", args.memory] if args.memory else [])
    os.environ.setdefault("SPILL_LOG_MAX_BYTES", str(256 * 2**20))   # admission's budget line stays in its log
    subprocess.run(up, check=True)
    try:
        subprocess.run(["spill", "run", args.model, args.input, "--output", f"/tmp/group_memory_{os.getpid()}.jsonl", "--new"], check=True)
        time.sleep(1)
        result["actors"] = actors()
        for k, v in result["actors"].items():
            print(k, {f: round(b / 2**20) for f, b in v.items()}, "MiB")
        home = config.home()
        logs = sorted((home / "run/logs").glob("admission.log*"), key=lambda f: f.stat().st_mtime)
        lines = [json.loads(ln) for f in logs for ln in f.read_text().splitlines()]
        budget = [ln for ln in lines if ln.get("event") == "budget"]
        result["priced_others"] = budget[-1].get("others") if budget else None
        print("admission's budget line:", budget[-1] if budget else None)
    finally:
        subprocess.run(["spill", "down"], check=False)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
