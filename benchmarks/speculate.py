"""Drafts verified in the pass on a real model: the same rows through `spill run` with each `--speculate`
setting, tier by tier; passes, tokens a decode row a pass, drafts proposed and accepted, and whether every row's
text is the same as without drafts.

    python benchmarks/speculate.py MODEL [--tiers edit,document] [--settings off,4] [--rows 16] [--stream]
        [--read-rate BYTES_S] [--draft DRAFT_MODEL] [--memory SIZE] [--kv-bits 8 --kv-group-size 32]
        [--out /tmp/spill-spec-bench]

Each tier is a prompt set of benchmarks/data (open questions, summaries, edits, documents; NOTICE.md gives their
sources). `--read-rate` caps the weight reader's bytes/s (SPILL_TEST_READ_RATE): a slow disk under a fast compute,
the ratio of the machines spill is for, where `auto` has a read to hide drafts under. Every run has its own
SPILL_HOME under --out, starting from the calibration the run before it left (none probes twice, and a setting
given twice, `4,4`, prices its second run's estimate with the drafts' acceptance the first one measured).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a model folder (e.g. `spill import-gguf`'s SmolLM2)")
    p.add_argument("--tiers", default="edit,document", help="prompt sets of benchmarks/data, comma-separated")
    p.add_argument("--settings", default="off,4", help="--speculate values, the first the baseline")
    p.add_argument("--rows", type=int, default=16, help="rows of each tier (its first)")
    p.add_argument("--max-tokens", type=int, help="every row's max_tokens (default: each row's own)")
    p.add_argument("--stream", action="store_true", help="stream the weights every pass (--stream)")
    p.add_argument("--read-rate", type=float, default=0.0, help="bytes/s the reader reads at most (0: no cap)")
    p.add_argument("--draft", help="a draft model for every setting but off (--draft), in place of prompt lookup")
    p.add_argument("--memory", help="spill's --memory (a cap below the model's size, on a GPU where a cgroup caps the host)")
    p.add_argument("--kv-bits", type=int, help="every setting's --kv-bits (quantized KV; default: unquantized)")
    p.add_argument("--kv-group-size", type=int, help="every setting's --kv-group-size (with --kv-bits)")
    p.add_argument("--out", type=Path, default=Path("/tmp/spill-spec-bench"))
    return p.parse_args()


def texts(path: Path) -> dict[str, str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in rows}


def passes(home: Path) -> list[dict]:
    (job,) = list((home / "jobs").iterdir())
    lines = [json.loads(line) for line in (job / "passes.jsonl").read_text().splitlines()]
    return [p for p in lines if "seconds" in p]


def decode_only(ps: list[dict]) -> dict:
    """Passes that took in no prompt token: their count, seconds and decode tokens a second (a prompt's passes cost
    what they cost with drafts or without); and every pass as [seconds, decode rows, prompt tokens, accepted, columns,
    read_s, compute_s, wait_s]."""
    only = [p for p in ps if not p.get("prefill_tokens")]
    seconds = sum(p["seconds"] for p in only)
    tokens = sum(p["decode_rows"] + sum(n for _, n in p.get("accepted", [])) for p in only)
    return {"decode_only_passes": len(only), "decode_only_s": round(seconds, 2),
            "decode_only_tokens_per_s": round(tokens / max(seconds, 1e-9), 2),
            "each_pass": [[round(p["seconds"], 4), p["decode_rows"], p.get("prefill_tokens", 0),
                           sum(n for _, n in p.get("accepted", [])), p.get("columns", 1),
                           *(round(p.get(k, 0.0), 4) for k in ("read_s", "compute_s", "wait_s"))] for p in ps]}


def run(a, tier: str, setting: str, rows: Path, seed_from: Path | None, n: int) -> dict:
    home = a.out / f"{tier}-{n}-{setting}"   # a setting given twice runs twice, each in a home of its own
    shutil.rmtree(home, ignore_errors=True)
    if seed_from is not None:
        shutil.copytree(seed_from / "calibration", home / "calibration")
    out = a.out / f"{tier}-{n}-{setting}.out.jsonl"
    env = {**os.environ, "SPILL_HOME": str(home), **({"SPILL_TEST_READ_RATE": str(a.read_rate)} if a.read_rate else {})}
    cmd = [sys.executable, "-m", "spill.coordinator.cli", "run", a.model, str(rows), "-o", str(out), "--new",
           "--quiet", "--speculate", setting, *(["--stream"] if a.stream else []),
           *(["--draft", a.draft] if a.draft and setting != "off" else []),
           *(["--max-tokens", str(a.max_tokens)] if a.max_tokens else []),
           *(["--memory", a.memory] if a.memory else []),
           *(["--kv-bits", str(a.kv_bits)] if a.kv_bits else []),
           *(["--kv-group-size", str(a.kv_group_size)] if a.kv_group_size else [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{tier} --speculate {setting} failed:\n{proc.stdout}\n{proc.stderr}")
    ps = passes(home)
    decode = sum(p["decode_rows"] for p in ps)
    accepted = sum(n for p in ps for _, n in p.get("accepted", []))
    meta = json.loads(next((home / "jobs").iterdir()).joinpath("job.json").read_text())
    summary = meta.get("summary") or {}
    return {"tier": tier, "speculate": setting, "rows": len(texts(out)), "passes": len(ps),
            "estimate_s": summary.get("estimate_seconds"), "actual_s": summary.get("actual_seconds"),
            "decode_row_passes": decode, "proposed": sum(n for p in ps for _, n in p.get("drafted", [])),
            "accepted": accepted, "tokens_per_decode_row": round((decode + accepted) / max(decode, 1), 3),
            "pass_s": round(sum(p["seconds"] for p in ps), 2),
            "decode_tokens_per_s": round((decode + accepted) / max(sum(p["seconds"] for p in ps), 1e-9), 2),
            "rows_per_pass_max": max((p["decode_rows"] for p in ps), default=0), "wall_s": round(wall, 1), "home": str(home),
            **decode_only(ps),
            "output": str(out), "summary": proc.stdout.strip().splitlines()[-3:]}


def main() -> None:
    a = parse()
    a.out.mkdir(parents=True, exist_ok=True)
    results, seed = [], None
    for tier in a.tiers.split(","):
        rows = a.out / f"{tier}.jsonl"
        rows.write_text("".join((DATA / f"{tier}.jsonl").read_text().splitlines(keepends=True)[:a.rows]))
        base = None
        for n, setting in enumerate(a.settings.split(",")):
            r = run(a, tier, setting, rows, seed, n)
            seed = Path(r["home"])   # the next run starts from this one's calibration (its drafts' acceptance too)
            if base is None:
                base = r
            else:
                mine, theirs = texts(Path(r["output"])), texts(Path(base["output"]))
                r.update(identical=mine == theirs, same_rows=sum(mine.get(k) == v for k, v in theirs.items()), fewer_passes=round(base["passes"] / r["passes"], 3),
                         pass_time_ratio=round(base["pass_s"] / max(r["pass_s"], 1e-9), 3),
                         tokens_per_s_ratio=round(r["decode_tokens_per_s"] / max(base["decode_tokens_per_s"], 1e-9), 3),
                         decode_only_ratio=round(r["decode_only_tokens_per_s"] / max(base["decode_only_tokens_per_s"],
                                                                                    1e-9), 3))
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k not in ("home", "output", "each_pass")}), flush=True)
    (a.out / "result.json").write_text(json.dumps({"model": a.model, "args": vars(a) | {"out": str(a.out)},
                                                    "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
