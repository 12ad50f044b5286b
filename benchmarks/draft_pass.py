"""What a drafting pass costs beyond a plain one, step by step: the same decode rows through the streamer core,
plain passes and passes of k drafts a row in turn, each step timed with the device synchronized after it; then
the attention kernel and the KV write alone at 1 and 1 + k queries a row, and attention's first call at a new key
length, batch or chunk width.

    python benchmarks/draft_pass.py MODEL [--rows 16] [--k 4] [--passes 8] [--stream] [--device gpu|cpu]
        [--json FILE]

The drafts are forced (each row's last token, k times: most are rejected), so every row carries k every drafting
pass and the cost is the chunk's, not lookup's luck. Rows never stop on EOS, so the batch stays whole.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from spill.messages import RowSampling
from spill.streamer import attention, core, speculate
from spill.streamer.records import Row

DATA = Path(__file__).resolve().parent / "data"
STEPS = {}   # step name -> seconds of the pass under way


def timed(name: str, fn):
    def run(*args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        mx.synchronize()
        STEPS[name] = STEPS.get(name, 0.0) + time.perf_counter() - t0
        return out
    return run


def forced(k: int):
    def proposals(decode, bounds, draft=None):
        return {id(r): [r.tokens[-1]] * k for p in decode.pools for r in p.live if bounds.get(r.row.id)}
    return proposals


def prompts(model: str, rows: int) -> list[list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    lines = [json.loads(line) for line in (DATA / "edit.jsonl").read_text().splitlines() if line.strip()]
    return [list(tok.apply_chat_template(r["body"]["messages"], add_generation_prompt=True, tokenize=True,
                                         return_dict=False)) for r in (lines * rows)[:rows]]


def passes(a) -> dict:
    dtype = mx.float32 if a.device == "cpu" else "auto"
    s = core.Streamer(a.model, resident=not a.stream, dtype=dtype, speculate=a.k)
    for i, ids in enumerate(prompts(a.model, a.rows)):
        s.add(Row(i, ids, 4096, RowSampling(0.0, 1.0, 0, 0), frozenset()))
    while s.waiting or s.prefills:
        s.step()
    speculate.proposals = timed("propose", forced(a.k))
    speculate.chunk = timed("chunk", speculate.chunk)
    speculate.decide = timed("verify", speculate.decide)
    speculate.draw = timed("head+sample", speculate.draw)
    s._stream_layers = timed("layers", s._stream_layers)
    out = {"plain": [], "draft": []}
    for n in range(2 * (a.passes + 2)):
        kind = "draft" if n % 2 else "plain"
        STEPS.clear()
        t0 = time.perf_counter()
        report = s.step({r: a.k for r in range(a.rows)} if kind == "draft" else None)
        seconds = time.perf_counter() - t0
        if n >= 4:   # the first two of each: warm-up
            out[kind].append({"pass_s": seconds, "rows": report.decode_rows, "columns": report.columns,
                              "read_s": report.read_s, **STEPS})
    s.close()
    return out


def kernels(a, heads: int, kv: int, dim: int, span: int) -> list[dict]:
    """Attention over a pool of `span` columns and the KV write, at 1 and 1 + k queries a row, each call synced."""
    dtype = mx.float32 if a.device == "cpu" else mx.bfloat16
    keys = mx.random.normal((a.rows, kv, span + 8, dim)).astype(dtype)
    values = mx.random.normal(keys.shape).astype(dtype)
    out = []
    for t in (1, 1 + a.k):
        q = mx.random.normal((a.rows, heads, t, dim)).astype(dtype)
        mask = mx.array((mx.arange(span)[None, :] <= (span - t + mx.arange(t))[:, None]))[None, None]
        mask = mx.broadcast_to(mask, (a.rows, 1, t, span))
        at = mx.broadcast_to((span - t + mx.arange(t)).astype(mx.int32)[None, None, :, None], (a.rows, kv, t, dim))
        new = mx.random.normal((a.rows, kv, t, dim)).astype(dtype)
        cases = {"attention": lambda: mx.fast.scaled_dot_product_attention(
                     q, keys[:, :, :span], values[:, :, :span], scale=dim ** -0.5, mask=mask),
                 "attention, no mask": lambda: mx.fast.scaled_dot_product_attention(
                     q, keys[:, :, :span], values[:, :, :span], scale=dim ** -0.5),
                 "kv write": lambda: mx.put_along_axis(keys, at, new, axis=2)}
        for name, fn in cases.items():   # each shape warmed once, then timed
            mx.eval(fn())
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                mx.eval(fn())
                times.append(time.perf_counter() - t0)
            out.append({"kernel": name, "queries": t, "ms": 1e3 * statistics.median(times)})
    out += first_calls(a, heads, kv, dim, span, dtype)
    return out


def first_calls(a, heads: int, kv: int, dim: int, span: int, dtype) -> list[dict]:
    """Attention's first call at a shape it has not run: a new key length, a new batch, a new chunk width (1 + k)
    each call, against the same shape again; where a backend makes a plan per shape, the first calls show it. Both
    ways a chunk can attend: MLX's fused kernel and the three ops (`attention.by_ops`)."""
    def call(fn, b: int, t: int, s: int) -> float:
        q = mx.random.normal((b, heads, t, dim)).astype(dtype)
        k, v = (mx.random.normal((b, kv, s, dim)).astype(dtype) for _ in range(2))
        mask = mx.ones((b, 1, t, s), dtype=mx.bool_)
        mx.eval(q, k, v, mask)
        t0 = time.perf_counter()
        mx.eval(fn(q, k, v, scale=dim ** -0.5, mask=mask))
        return 1e3 * (time.perf_counter() - t0)

    t, out = 1 + a.k, []
    for way, fn in (("fused", mx.fast.scaled_dot_product_attention), ("ops", attention.by_ops)):
        base = span + (0 if way == "fused" else 64)   # shapes the other way has not met either
        shapes = {"a new key length": [(a.rows, t, base + 1 + j) for j in range(6)],
                  "a new batch": [(a.rows + 1 + j, t, base) for j in range(6)],
                  "a new chunk width": [(a.rows, 2 + j, base + 7) for j in range(6)],
                  "the same shape": [(a.rows, t, base)] * 6}
        out += [{"kernel": f"attention ({way}), {name}", "queries": t, "ms": statistics.median([call(fn, *x) for x in xs])}
                for name, xs in shapes.items()]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--passes", type=int, default=8, help="timed passes of each kind")
    p.add_argument("--stream", action="store_true", help="read the layers every pass (else resident)")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    result = {"args": {k: str(v) for k, v in vars(a).items()}, "passes": passes(a)}
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    result["kernels"] = kernels(a, heads, cfg.get("num_key_value_heads", heads),
                                cfg.get("head_dim", cfg["hidden_size"] // heads), span=512)
    layers = cfg["num_hidden_layers"]
    print(f"{a.model}: {a.rows} rows, k = {a.k}, {'streamed' if a.stream else 'resident'}, {a.device}, "
          f"{layers} layers; medians of {a.passes} passes each")
    names = sorted({k for ps in result["passes"].values() for p in ps for k in p if k not in ("rows", "columns")})
    print("| step | " + " | ".join(result["passes"]) + " | drafting - plain, ms |")
    print("|---|---|---|---|")
    for name in names:
        med = [1e3 * statistics.median([p.get(name, 0.0) for p in ps]) for ps in result["passes"].values()]
        print(f"| {name} | " + " | ".join(f"{m:.2f}" for m in med) + f" | {med[-1] - med[0]:+.2f} |")
    print("| kernel | queries | ms a call |\n|---|---|---|")
    for k in result["kernels"]:
        print(f"| {k['kernel']} | {k['queries']} | {k['ms']:.3f} |")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
