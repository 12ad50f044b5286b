"""What the streamer holds, by component, at its peak in prefill and in steady decode (issue 6's prices).

    python benchmarks/memory_probe.py FOLDER [--batch 8] [--prompt-tokens 4] [--passes 2] [--cache-limit MIB]

One process runs the streamer in its own interpreter with admission's cache limit; after every layer
of every pass it samples MLX active and cache memory and MLX's peak since the pass began, and per
pass the peak RSS (VmHWM, reset each pass). Printed per pass: the peaks, the interpreter's baseline
RSS before any weight, the reader's buffers and admission's priced components (all MiB).
"""

import argparse
import json
import sys
import time
from pathlib import Path

MIB = 2**20


def hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")   # Linux: resets VmHWM to the current RSS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=4)
    p.add_argument("--passes", type=int, default=2, help="decode passes after the prefill pass")
    p.add_argument("--cache-limit", type=float, default=0, help="MLX's cache limit in MiB (default: admission's)")
    a = p.parse_args()
    import mlx.core as mx
    from spill import memory
    from spill.admission.prices import sheet_for
    from spill.streamer.core import Row, Streamer
    baseline = memory.process_memory().rss   # the interpreter and libraries: what the group prices as runtime
    s = Streamer(a.folder)
    b, prompt = a.batch, a.prompt_tokens
    width = prompt + a.passes + 2
    sheet = sheet_for(s.plan, 2**40, 4, prefill_tokens=b * prompt, others=baseline)
    s.reserve([[b, width]])
    limit = int(a.cache_limit * MIB) or sheet.cache_limit
    s.set_cache_limit(limit)
    samples: list[tuple[int, int, int]] = []
    unload = s.adapter.unload_layer

    def sampled_unload(i):   # after layer i's eval, before its weights are dropped
        samples.append((mx.get_active_memory(), mx.get_cache_memory(), mx.get_peak_memory()))
        unload(i)
    s.adapter.unload_layer = sampled_unload
    for j in range(b):
        s.add(Row(j, [(7 * j + k) % 1000 + 3 for k in range(prompt)], max_tokens=a.passes + 2, width=width))
    out = {"folder": a.folder, "batch": b, "prompt": prompt, "baseline": baseline // MIB,
           "reader": s.reader.buffer_bytes / MIB, "cache_limit": limit / MIB,
           "priced": {k: round(v / MIB, 1) for k, v in sheet.fixed.items()},
           "kv_priced": round(sheet.cost(b, width) / MIB, 1), "passes": []}
    for k in range(a.passes + 1):
        samples.clear()
        mx.reset_peak_memory()
        reset_hwm()
        t0, before = time.perf_counter(), memory.process_memory()
        r = s.step()
        act = [x[0] for x in samples]
        tot = [x[0] + x[1] for x in samples]
        out["passes"].append({
            "pass": k, "kind": "prefill" if r.prefill_tokens else "decode", "seconds": round(time.perf_counter() - t0, 1),
            "active_max": max(act) / MIB, "active_plus_cache_max": max(tot) / MIB,
            "cache_max": max(x[1] for x in samples) / MIB, "mlx_peak": mx.get_peak_memory() / MIB,
            "rss_peak": hwm() / MIB, "rss_end": memory.process_memory().rss / MIB,
            "minor_faults": memory.process_memory().minor_faults - before.minor_faults,
            "after": {"active": mx.get_active_memory() / MIB, "cache": mx.get_cache_memory() / MIB}})
        print(json.dumps(out["passes"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
