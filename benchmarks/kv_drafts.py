"""Where drafts (or the batch) change a row's greedy text over quantized KV: the same rows through the streamer core
twice, every column's K and V recorded as computed, before quantization, and every token's logits.

    python benchmarks/kv_drafts.py MODEL [--tier edit] [--runs 0:16,4:16] [--kv-bits 8] [--kv-group-size 32]

`--runs`: each run's --speculate K (0: off) and rows (the tier's first N), the first the baseline. Rows run resident,
all added at the first pass, with OpenBLAS preloaded as `spill run` runs them. Per row of both runs: the first output
token that differs, each run's top-2 logit margin there, the largest logit difference before it, and over the K/V
columns that token's decision read the largest difference before quantization, the codes that differ and the first
(column, layer) where one does. Each pool's stored codes are also compared with `mx.quantize` of the K and V last
written at each column (every 7th pass, layers 0 and the last): a stale or misplaced column shows there.
"""

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from spill.streamer import check

DATA = Path(__file__).resolve().parent / "data"


@dataclass
class Run:
    tokens: dict = field(default_factory=dict)    # row -> its tokens (an EOS included)
    logits: dict = field(default_factory=dict)    # row -> each token's logits
    kv: dict = field(default_factory=dict)        # (row, layer) -> {column: (k, v)} as last written, float32
    prompts: dict = field(default_factory=dict)   # row -> prompt length
    checked: int = 0                              # (row, layer) stored-code checks, and those that differed
    stale: int = 0


def record(model, prompts: dict, max_tokens: dict, eos, speculate: int, bits: int | None, group: int) -> Run:
    """The rows through a resident Streamer, greedy, up to `speculate` prompt-lookup drafts a row a pass."""
    from spill.streamer import groups, kvquant
    from spill.streamer.core import Row, Streamer
    run = Run(prompts={r: len(p) for r, p in prompts.items()})
    cache = kvquant.QuantSlotCache if bits else groups.SlotCache
    update, join = cache.update_and_fetch, groups.Pool.join

    def keep(rows, layer, keys, values, columns):   # keys [rows, heads, T, dim] -> the columns' last writes
        k, v = np.array(keys.astype(mx.float32)), np.array(values.astype(mx.float32))
        for j, r in enumerate(rows[:k.shape[0]]):
            if r is not None:
                run.kv.setdefault((r.row.id, layer), {}).update(
                    (int(c), (k[j, :, t], v[j, :, t])) for t, c in enumerate(columns(j)))

    def recorded_update(self, keys, values):
        at = np.array(self.pool.write_at)
        keep(self.pool.rows, self.pool.caches.index(self), keys, values, lambda j: at[j, 0, :, 0])
        return update(self, keys, values)

    def recorded_join(self, g, picks):   # a joining row's prompt KV, as its prefill group computed it
        pads, end = g.caches[0].left_padding.tolist(), g.caches[0]._idx
        for layer, c in enumerate(g.caches):
            for j in picks:
                keep([g.rows[j]], layer, c.keys[j:j + 1, :, pads[j]:end], c.values[j:j + 1, :, pads[j]:end],
                     lambda _, n=end - pads[j]: range(n))
        return join(self, g, picks)

    cache.update_and_fetch, groups.Pool.join = recorded_update, recorded_join
    try:
        streamer = Streamer(model, keep_logits=True, kv_bits=bits, kv_group_size=group, resident=True)
        for rid, p in prompts.items():
            streamer.add(Row(rid, p, max_tokens[rid], eos_ids=frozenset(eos)))
            run.tokens[rid], run.logits[rid] = [], []
        while not streamer.idle:
            bounds = {r.row.id: speculate for p in streamer.pools.values() for r in p.live} if speculate else None
            report = streamer.step(bounds)
            for e in report.emitted:
                run.tokens[e.row_id].append(e.token)
                run.logits[e.row_id].append(e.logits)
            if bits and streamer.passes % 7 == 0:
                _check_stored(run, streamer, bits, group)
        streamer.close()
    finally:
        cache.update_and_fetch, groups.Pool.join = update, join
    return run


def _check_stored(run: Run, streamer, bits: int, group: int) -> None:
    for p in streamer.pools.values():
        for j, r in enumerate(p.rows):
            for layer in (0, len(p.caches) - 1) if r is not None else ():
                kv, n = run.kv[(r.row.id, layer)], int(p.lens[j])
                want = mx.quantize(mx.array(np.stack([kv[c][0] for c in range(n)], axis=1)), group_size=group, bits=bits)
                run.checked += 1
                run.stale += not all(np.array_equal(np.array(w), np.array(s[j, :, :n])) for w, s in zip(want, p.caches[layer].keys))


def margin(logits: np.ndarray) -> tuple[int, float]:
    """(the argmax, its lead over the second largest logit)."""
    return int(np.argmax(logits)), check.margin(logits)


def codes(x: np.ndarray, bits: int, group: int) -> np.ndarray:
    """A vector's quantized codes, one a value, out of MLX's packed uint32 words (bits 8 or 4)."""
    packed = np.array(mx.quantize(mx.array(x[None]), group_size=group, bits=bits)[0])
    return (packed[..., None] >> np.arange(0, 32, bits, dtype=np.uint32)) & np.uint32((1 << bits) - 1)


def compare_row(a: Run, b: Run, rid, bits: int | None, group: int) -> dict:
    """One row of two runs: where its tokens first differ and what the decisions up to there read."""
    d = check.first_difference(a.tokens[rid], b.tokens[rid])
    n = min(len(a.tokens[rid]), len(b.tokens[rid])) if d is None else d
    out = {"row": rid, "tokens": [len(a.tokens[rid]), len(b.tokens[rid])], "first_difference": d,
           "logit_difference_before": max((float(np.abs(x - y).max()) for x, y in
                                           zip(a.logits[rid][:n], b.logits[rid][:n])), default=0.0)}
    columns = a.prompts[rid] + (n - 1 if d is None else d)   # the decision at d reads columns 0..columns-1
    far, differ, total, first = 0.0, 0, 0, None
    for layer in range(len({k[1] for k in a.kv})):
        for c in range(columns):
            for which, (x, y) in zip("kv", zip(a.kv[(rid, layer)][c], b.kv[(rid, layer)][c])):
                far = max(far, float(np.abs(x - y).max()))
                if bits:
                    moved = int((codes(x, bits, group) != codes(y, bits, group)).sum())
                    differ, total = differ + moved, total + x.size
                    if moved and (first is None or (c, layer) < (first["column"], first["layer"])):
                        first = {"column": c, "layer": layer, "kv": which, "codes": moved,
                                 "float_difference": float(np.abs(x - y).max())}
    out.update(kv_difference=far, codes_differing=[differ, total], first_code_difference=first)
    if d is not None and d < min(len(a.logits[rid]), len(b.logits[rid])):
        out["margins"] = [margin(a.logits[rid][d]), margin(b.logits[rid][d])]
    return out


def tier_rows(model, tier: str, rows: int) -> tuple[dict, dict, list]:
    """The tier's first rows as prompt ids (the model's chat template), their max_tokens, and the EOS ids."""
    from spill.tokenizer_worker.core import TokenizerCore
    tok = TokenizerCore(model)
    lines = [json.loads(x) for x in (DATA / f"{tier}.jsonl").read_text().splitlines()[:rows]]
    prompts = {r["custom_id"]: list(tok.tokenizer.apply_chat_template(r["body"]["messages"], add_generation_prompt=True))
               for r in lines}
    return prompts, {r["custom_id"]: r["body"].get("max_tokens", 256) for r in lines}, tok.eos


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--tier", default="edit", help="a prompt set of benchmarks/data")
    p.add_argument("--runs", default="0:16,4:16", help="speculate:rows of each run, the first the baseline")
    p.add_argument("--kv-bits", default="8", help="8, 4 or none (unquantized)")
    p.add_argument("--kv-group-size", type=int, default=32)
    a = p.parse_args()
    from spill.platform import reexec_with_preload
    reexec_with_preload([__file__, *sys.argv[1:]])
    bits = None if a.kv_bits == "none" else int(a.kv_bits)
    runs = [tuple(map(int, r.split(":"))) for r in a.runs.split(",")]
    prompts, max_tokens, eos = tier_rows(a.model, a.tier, max(n for _, n in runs))
    done = [record(a.model, dict(list(prompts.items())[:n]), max_tokens, eos, k, bits, a.kv_group_size)
            for k, n in runs]
    step = max(float(np.abs(x).max()) for r in done for ls in r.logits.values() for x in ls) * 2.0 ** -(bits or 32)
    print(json.dumps({"stored_checks": [[r.checked, r.stale] for r in done], "one_kv_step_at_largest_logit": step}))
    for (k, n), run in zip(runs[1:], done[1:]):
        rows = [compare_row(done[0], run, rid, bits, a.kv_group_size) for rid in run.tokens if rid in done[0].tokens]
        for row in rows:
            print(json.dumps({"run": f"{k}:{n}", **row}))
        print(json.dumps({"run": f"{k}:{n}", "identical": sum(r["first_difference"] is None for r in rows),
                          "of": len(rows)}))


if __name__ == "__main__":
    main()
