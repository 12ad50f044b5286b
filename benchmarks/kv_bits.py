"""Quantized KV at one memory cap: the same job through `spill run` in a child memory cgroup, with the decode
pools' KV unquantized, 8-bit and 4-bit (`--kv-bits`): rows per pass, decode tokens/s and pass time of each.

    python benchmarks/kv_bits.py [--size small] [--rows 240] [--max-tokens 48] [--limit 900MiB] [--group-size 64]
                                 [--formats none,8,4] [--memory SIZE --dtype bfloat16]   (the GPU: --memory, no cgroup)

1. builds a factory model (`small` in float32 by default) and a job of short questions (35-55 tokens each,
   three_tier.py's, --max-tokens new tokens each);
2. runs `spill run MODEL INPUT --stream --kv-bits B --kv-group-size G` once per format (the weights streamed every
   pass, as a model larger than the cap is), each inside its own child cgroup of --limit bytes (no --memory: spill
   finds the limit), in one data home whose calibration the first run makes;
3. prints per format, from the job's passes.jsonl: the most and the median running rows of a pass (the median
   over the passes that decode), decode tokens/s (decode rows summed over the passes' seconds), the median
   pass; the cgroup's peak and OOM kills; and that every custom_id is in the output once, without an error.
Root is needed for the cgroup (v1, under this process's own) and to drop the page cache.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))   # last: tests.machine; an installed spill wins
import three_tier  # noqa: E402
from job import job_files, spill_in_cgroup  # noqa: E402
from pass_time import drop_cache, model_args, model_folder  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_args(p, "small")
    p.add_argument("--rows", type=int, default=240)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--limit", default="900MiB", help="every run's child cgroup limit (the working set)")
    p.add_argument("--memory", help="no cgroup: spill's --memory (the GPU's cap, where a cgroup caps only the host)")
    p.add_argument("--group-size", type=int, default=64, help="--kv-group-size of the quantized runs")
    p.add_argument("--formats", default="none,8,4", help="KV formats in the order run: none (unquantized), 8, 4")
    p.add_argument("--data", type=Path, default=three_tier.DATA, help="the folder of gsm8k_test.jsonl")
    p.add_argument("--home", default="/tmp/spill-kv-bench-home", help="the runs' SPILL_HOME")
    p.add_argument("--out", type=Path, default=Path("/tmp/spill-kv-bench"))
    p.set_defaults(dtype="float32")   # stored as computed on a CPU
    return p.parse_args()


def job_rows(n: int, max_tokens: int, count, data: Path) -> list[dict]:
    qs = [q for q in three_tier.questions(data) if 35 <= count(q) <= 55]
    return [{"custom_id": f"q-{i:04d}", "method": "POST", "url": "/v1/chat/completions", "body": {"max_tokens": max_tokens,
                                                 "messages": [{"role": "user", "content": qs[i % len(qs)]}]}}
            for i in range(n)]


def decode_tokens(p: dict) -> int:
    """A pass's decode tokens: every token it emitted where no prompt ran in it (a pipeline's pass of several rounds
    included); else its decode rows', one each (the tokens of rows that ended their prompt are no decode's)."""
    return p["emitted"] if not p["prefill_tokens"] else p["decode_rows"]


def figures(passes: list[dict], out: Path, ids: list[str]) -> dict:
    """Rows per pass, decode tokens/s, pass time; and whether every custom_id came back once, without an error."""
    decoding = [p for p in passes if p["decode_rows"]]
    seconds = sum(p["seconds"] for p in passes)
    lines = [json.loads(line) for line in open(out)]
    seen = Counter(line["custom_id"] for line in lines)
    return {"passes": len(passes), "rows_per_pass_max": max((p["decode_rows"] for p in passes), default=0),
            "rows_per_pass_median": statistics.median(p["decode_rows"] for p in decoding) if decoding else 0,
            "decode_tokens_per_s": round(sum(map(decode_tokens, passes)) / seconds, 2) if seconds else None,
            "pass_s_median": round(statistics.median(p["seconds"] for p in passes), 3),
            "job_s": round(seconds, 1),
            "every_id_once": sorted(seen) == sorted(ids) and set(seen.values()) == {1},
            "errors": sum(line.get("error") is not None for line in lines)}


def spill_capped(args: list, env: dict, log: Path) -> str:
    """Run `spill ARGS` (its --memory the cap); return the job id it printed."""
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "spill.coordinator.cli", *map(str, args)], stdout=f,
                              stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        raise SystemExit(f"spill run exited {proc.returncode}; its output:\n{log.read_text()[-3000:]}")
    return re.search(r"job (\S+): \d+ rows", log.read_text()).group(1)


def main() -> None:
    a = parse()
    from spill.memory import format_size, parse_size
    limit = parse_size(a.memory or a.limit)
    a.out.mkdir(parents=True, exist_ok=True)
    home = Path(a.home)
    env = {**os.environ, "SPILL_HOME": str(home)}
    os.environ["SPILL_HOME"] = str(home)
    folder = model_folder(a)
    rows = job_rows(a.rows, a.max_tokens, three_tier.counter(str(folder)), a.data)
    inp = a.out / "questions.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cap = f"--memory {format_size(limit)}" if a.memory else f"cgroup limit {format_size(limit)}"
    print(f"model {folder}; {len(rows)} rows, max_tokens {a.max_tokens}; {cap}", flush=True)
    result = {"model": str(folder), "limit": limit, "rows": len(rows), "max_tokens": a.max_tokens, "runs": {}}
    for fmt in a.formats.split(","):
        kv = [] if fmt == "none" else ["--kv-bits", fmt, "--kv-group-size", str(a.group_size)]
        out = a.out / f"{fmt}.out.jsonl"
        out.unlink(missing_ok=True)
        drop_cache(sorted(folder.glob("*.safetensors")))
        print(f"KV {fmt}: spill run {' '.join(kv)}", flush=True)
        t0 = time.time()
        args = ["run", folder, inp, "-o", out, "--quiet", "--new", "--stream", *kv]
        job = (spill_capped(args + ["--memory", a.memory], env, a.out / f"{fmt}.log") if a.memory else
               spill_in_cgroup(args, limit, env, a.out / f"{fmt}.log"))   # exits on an OOM kill
        meta, passes = job_files(home, job)
        run = {"job": job, "wall_s": round(time.time() - t0, 1), "oom_kills": 0,
               "kv": (meta.get("summary") or {}).get("kv"), "estimate_s": (meta.get("estimate") or {}).get("total_seconds"),
               "actual_s": (meta.get("summary") or {}).get("actual_seconds"), **figures(passes, out, [r["custom_id"] for r in rows])}
        result["runs"][fmt] = run
        print(json.dumps(run), flush=True)
    base = result["runs"].get("none")
    for fmt, run in result["runs"].items():
        if base and fmt != "none":
            run["rows_per_pass_over_unquantized"] = round(run["rows_per_pass_max"] / base["rows_per_pass_max"], 2)
            run["tokens_per_s_over_unquantized"] = round(run["decode_tokens_per_s"] / base["decode_tokens_per_s"], 2)
    (a.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
