"""Memory per pass under the budget, inside a child memory cgroup (DESIGN.md sections 5 and 9).

    python benchmarks/memory.py [--size 1b] [--limit 4.5GB] [--batches 8,32,128] [--passes 4]

For each batch, a child process inside a cgroup of --limit bytes (the working set spill detects)
prices the model with admission's sheet, reserves the decode pool, sets MLX's cache limit from the
budget, prefills the batch and runs decode passes; every pass it records live allocation (the
largest of MLX active + cache + reader buffers and the RSS) after the pass and at its peak (the peak
RSS, reset each pass), MLX's peak, the cgroup's usage, minor and major page faults and the pass time;
and the batch the budget allows at the benchmark's width and at admission's (its width class). --python runs the children with another interpreter (another
checkout: the code before), which may lack the pool and the cache limit; it then runs without them.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))   # last: tests.machine; an installed spill wins
from tests.machine import ChildCgroup  # noqa: E402
from pass_time import drop_cache, model_args, model_folder, resident_decode  # noqa: E402

MIB = 2**20


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_args(p, "1b")
    p.add_argument("--limit", default="4.5GB", help="the child cgroup's memory limit")
    p.add_argument("--batches", default="8,32,128", help="'max': the largest batch the budget allows")
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--python", default=sys.executable, help="interpreter of the children")
    p.add_argument("--resident", action="store_true", help="also time mlx-lm's resident decode step")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args()


# -- the parent: a child cgroup per run ----------------------------------------------------------------
def run_child(a, folder: Path, batch: int, limit: int) -> dict:
    cg = ChildCgroup(f"spill-bench-{os.getpid()}-{batch}", limit)
    try:
        drop_cache(sorted(folder.glob("*.safetensors")))   # page cache is charged to whoever reads first
        spec = json.dumps({"folder": str(folder), "batch": batch, "passes": a.passes, "prompt": a.prompt_tokens})
        out = subprocess.run(cg.command([a.python, __file__, "--child", spec]), capture_output=True, text=True)
        if out.returncode:   # recorded, and the next batch runs: the code before may not fit
            oom = cg.oom_kills() > 0
            print(out.stderr[-2000:], file=sys.stderr)
            return {"batch": batch, "failed": f"exited {out.returncode}{' (OOM-killed)' if oom else ''}", "passes": [],
                    "cgroup_peak": cg.peak()}
        result = json.loads(out.stdout.splitlines()[-1])
        result["cgroup_peak"] = cg.peak()
        return result
    finally:
        cg.remove()


# -- the child: one batch under the budget ---------------------------------------------------------------
def child(spec: dict) -> None:
    import mlx.core as mx
    from spill import memory
    from spill.streamer.core import Row, Streamer
    baseline = memory.process_memory().rss   # the interpreter and libraries, priced as the group prices its other processes
    s = Streamer(spec["folder"])
    ws = memory.working_set()
    b, prompt, passes = spec["batch"], spec["prompt"], spec["passes"]
    width = prompt + passes + 2
    sheet = None
    if hasattr(s, "reserve"):   # the code with the budget: admission's prices, the pool, the cache limit
        from spill.admission.policy import width_class
        from spill.admission.prices import sheet_for

        def price(n):
            return sheet_for(s.plan, ws.bytes, 4, prefill_tokens=n * prompt, others=baseline)
        if b == "max":   # the largest batch whose KV the budget buys, its prompts' prefill priced too
            b = max(n for n in range(1, 257) if price(n).kv_budget >= price(n).cost(n, width))
        sheet = price(b)
        s.reserve([[b, width]])
        s.set_cache_limit(sheet.cache_limit)
    for j in range(b):
        s.add(Row(j, [(7 * j + k) % 1000 + 3 for k in range(prompt)], max_tokens=passes + 2, **({"width": width} if sheet else {})))
    rows = []
    for k in range(passes + 1):
        before = memory.process_memory()
        mx.reset_peak_memory()
        reset_peak_rss()
        t0 = time.perf_counter()
        r = s.step()
        after = memory.process_memory()
        live = max(mx.get_active_memory() + mx.get_cache_memory() + s.reader.buffer_bytes, after.rss)
        rows.append({"pass": k, "seconds": time.perf_counter() - t0, "prefill": r.prefill_tokens > 0,
                     "live": live, "peak_live": max(live, peak_rss()), "active": mx.get_active_memory(),
                     "cache": mx.get_cache_memory(), "reader": s.reader.buffer_bytes,
                     "rss": after.rss, "cgroup": memory.cgroup_usage() or 0, "mlx_peak": mx.get_peak_memory(),
                     "minor": after.minor_faults - before.minor_faults, "major": after.major_faults - before.major_faults})
    allows = sheet and {w: min(256, sheet.kv_budget // sheet.cost(1, w)) for w in (width, width_class(width))}
    print(json.dumps({"batch": b, "working_set": ws.bytes, "source": ws.source, "passes": rows, "allows": allows,
                      "prices": sheet and sheet.fixed, "kv_budget": sheet and sheet.kv_budget,
                      "baseline": baseline, "budget": sheet.budget if sheet else None, "fixed": sheet and sum(sheet.fixed.values()),
                      "kv": sheet and sheet.cost(b, width), "layers": len(s.plan.layers),
                      "streamed": s.plan.streamed_bytes}))


def peak_rss() -> int:
    """This process's peak RSS since the last reset (VmHWM; Linux)."""
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.exists() else []
    return next((int(x.split()[1]) * 1024 for x in lines if x.startswith("VmHWM:")), 0)


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")   # VmHWM back to the current RSS
    except OSError:
        pass


def table(results: list[dict], resident: dict[int, float]) -> list[str]:
    out = ["| batch | budget MiB | pass | kind | seconds | live MiB | peak live MiB | peak / budget | cgroup MiB | minor faults | major faults |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("failed"):
            out.append(f"| {r['batch']} | - | - | - | {r['failed']} | - | - | - | {r['cgroup_peak'] // MIB} (peak) | - | - |")
        for p in r["passes"]:
            peak = p.get("peak_live", p["live"])
            ratio = f"{peak / r['budget']:.3f}" if r["budget"] else "-"
            out.append(f"| {r['batch']} | {r['budget'] and r['budget'] // MIB or '-'} | {p['pass']} | "
                       f"{'prefill' if p['prefill'] else 'decode'} | {p['seconds']:.2f} | {p['live'] // MIB} | {peak // MIB} | {ratio} | "
                       f"{p['cgroup'] // MIB} | {p['minor']} | {p['major']} |")
    for b, t in resident.items():
        out.append(f"\nresident mlx-lm decode step at batch {b}: {t:.2f} s")
    return out


def main() -> None:
    a = parse()
    if a.child:
        return child(json.loads(a.child))
    from spill.memory import parse_size
    folder = model_folder(a)
    limit = parse_size(a.limit)
    results = []
    for b in [x if x == "max" else int(x) for x in a.batches.split(",")]:
        results.append(run_child(a, folder, b, limit))
        r = results[-1]
        print(f"batch {r['batch']}: " + (r["failed"] if r.get("failed") else f"working set {r['working_set'] // MIB} MiB "
              f"({r['source']}), budget {r['budget'] and r['budget'] // MIB} MiB, allows {r.get('allows')}") +
              f", cgroup peak {r['cgroup_peak'] // MIB} MiB", flush=True)
        print(json.dumps(r), flush=True)   # each batch's figures as they come: a stopped run keeps them
    resident = {}
    if a.resident and "max" not in a.batches:
        prompts = [[(7 * j + k) % 1000 + 3 for k in range(a.prompt_tokens)] for j in range(max(map(int, a.batches.split(","))))]
        resident = resident_decode(folder, prompts, [max(map(int, a.batches.split(",")))], a.passes)
    print("\n".join(table(results, resident)))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
