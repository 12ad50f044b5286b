"""What the actor hops cost: time per pass through the group against the streamer core alone.

    python benchmarks/group_overhead.py [--model FOLDER] [--rows 32] [--max-tokens 12]

The same rows (short prompts, greedy, fixed max_tokens) run twice in one run on one machine:
1. the streamer core driven in-process; 2. a job through `spill`'s embedded group (coordinator,
tokenizer, admission, streamer processes over ZeroMQ). Time per pass is the wall time between
the first and the last pass over the passes between them, so it includes every hop.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from spill.platform import preload_env


def core_alone(folder: Path, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from spill.streamer.core import Row, Streamer
    s = Streamer(folder)
    for i, p in enumerate(prompts):
        s.add(Row(i, p, max_tokens))
    stamps = []
    while not s.idle:
        s.step()
        stamps.append(time.monotonic())
    s.close()
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1), len(stamps)


def through_group(folder: Path, texts: list[str], max_tokens: int) -> tuple[float, int]:
    from spill.coordinator.client import Client, endpoints, start_group
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "in.jsonl"
        inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": t, "max_tokens": max_tokens}) + "\n"
                               for i, t in enumerate(texts)))
        eps = endpoints()
        group, client = start_group(eps, embedded=True), Client(eps)
        try:
            info = client.request("submit", timeout_s=600, model=str(folder), input=str(inp),
                                  output=str(Path(tmp) / "out.jsonl"), max_tokens=max_tokens,
                                  temperature=0.0, resume=None, new=True, stream=True)   # as the core alone
            while (s := client.request("status", job=info["job"]))["status"] != "done":
                time.sleep(0.2)
        finally:
            client.request("down")
            group.wait()
    return s["wall_per_pass_s"], s["passes"]


def main() -> None:
    if os.environ.get("LD_PRELOAD") != preload_env().get("LD_PRELOAD"):
        os.execve(sys.executable, [sys.executable, *sys.argv], preload_env())
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="/tmp/spill-bench/llama-3b-bfloat16-seed0")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=12)
    a = p.parse_args()
    os.environ.setdefault("SPILL_HOME", tempfile.mkdtemp(prefix="spill-overhead-"))
    from mlx_lm.tokenizer_utils import load
    tok = load(Path(a.model))
    texts = [f"Question {i}: say something about the number {i * 7}." for i in range(a.rows)]
    prompts = [tok.encode(t) for t in texts]
    group_s, group_n = through_group(Path(a.model), texts, a.max_tokens)
    core_s, core_n = core_alone(Path(a.model), prompts, a.max_tokens)
    print(f"model {a.model}, {a.rows} rows, max_tokens {a.max_tokens}")
    print(f"core alone:    {core_s:.3f} s/pass over {core_n} passes")
    print(f"through group: {group_s:.3f} s/pass over {group_n} passes")
    print(f"hop overhead:  {100 * (group_s / core_s - 1):+.1f}% of pass time")


if __name__ == "__main__":
    main()
