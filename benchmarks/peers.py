"""spill against its peers on one model, one memory cap, the same token ids, greedy (issues 12 and 44).

    python benchmarks/peers.py [--size 1b] [--cap 1GiB] [--batches 1,16,64] [--spill-rows 256]
    python benchmarks/peers.py --model FOLDER --tier document,edit [--new 64] [--llama-kv f16,q8_0]
        [--spill-configs "off;--speculate auto --kv-bits 8 --kv-group-size 32"]

In one run on one machine: builds (or reuses) a factory llama under --models, or takes a real model folder
(--model), and its GGUF; measures the cold read bandwidth; then each run is a child process in a fresh child
memory cgroup (v1 or v2, under this process's own) with --cap bytes, page cache charged, the model's files dropped
from the cache first: spill through `spill run` (--spill-rows rows; its budget picks the batch; once per spill
configuration), llama.cpp (mmap, no repacking; once per KV cache type), transformers + accelerate (disk offload)
and mlx-lm (resident) at each batch. The rows are made-up text of --prompt tokens, or with --tier the real prompts
of benchmarks/data (each row's own length; --new is every row's max_tokens). A run that is OOM-killed or passes
--timeout is a result too. The cold read is measured again at the end. Writes one JSON line per run to --json and
the table into docs/benchmarks.md (peers markers).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))   # last: tests.machine; an installed spill wins
from pass_time import model_args, model_folder, read_all  # noqa: E402
from peers_report import reference, table, text_agreement, write_doc  # noqa: E402
from peers_rows import eos_ids, lengths_line, random_rows, tier_lines, token_ids, write_lines  # noqa: E402
from peers_run import capped, gpu_name  # noqa: E402
from peers_spill import run_spill, spill_configs  # noqa: E402

from spill.memory import parse_size  # noqa: E402
from spill.platform import preload_env  # noqa: E402

HERE = Path(__file__).resolve().parent
PEERS = ("spill", "llama.cpp", "accelerate", "mlx-lm")
OVER_CAP = 5   # peers_child's exit code for a peer whose GPU memory passed --gpu-cap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_args(p, "1b")
    p.add_argument("--model", default="", help="a real model folder (llama), in place of the factory's --size")
    p.add_argument("--tier", default="", help="real prompts: tiers of benchmarks/data, e.g. document,edit")
    p.add_argument("--rows", type=int, default=0, help="--tier's rows (its rows repeated in order; 0: each once)")
    p.add_argument("--cap", default="1GiB", help="the child cgroup's memory limit (below the model's size)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--new", type=int, default=32, help="tokens generated per row (with --tier: each row's max_tokens)")
    p.add_argument("--batches", default="1,16,64", help="the peers' batches")
    p.add_argument("--spill-rows", type=int, default=256, help="rows given to spill run (its budget picks the batch)")
    p.add_argument("--spill-cap", default="", help="also run spill at this cap (e.g. one its budget admits rows at)")
    p.add_argument("--spill-args", default="", help="extra `spill run` arguments for every spill run")
    p.add_argument("--spill-configs", default="", help="';'-separated `spill run` arguments, a spill run each "
                   "(`off`: --speculate off), e.g. \"off;--speculate auto --kv-bits 8 --kv-group-size 32\"")
    p.add_argument("--llama-kv", default="f16", help="llama.cpp's KV cache types, a run each at every batch "
                   "(type_k = type_v; f16, q8_0, q4_0), flash attention on")
    p.add_argument("--spill-budget-fraction", type=float, default=None, help="spill's --budget-fraction (its "
                   "guard and hard lines rise above it)")
    p.add_argument("--gpu-cap", default="", help="GPU memory each peer may hold where a GPU is (default: --cap)")
    p.add_argument("--cgroup-parent", default="", help="make the capped cgroups under this one (cgroup v2 where "
                   "this process's own cannot have children with a memory controller)")
    p.add_argument("--marker", default="peers", help="the docs markers the table goes between (e.g. peers-gpu)")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--mlx-batches", default="1", help="mlx-lm's batches (it is expected to die at load)")
    p.add_argument("--hf-batches", default="", help="accelerate's batches (default: --batches)")
    p.add_argument("--hf-gpu-share", default="0.5", help="shares of the GPU cap accelerate fills with weights "
                   "(the rest holds its KV and activations), e.g. 0.25,0.5: each runs at every batch")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one peer's run may take")
    p.add_argument("--spill-timeout", type=float, default=900.0, help="seconds spill's run may take (prefill included)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--work", default="/tmp/spill-peers", help="scratch: inputs, spill's data home, offload")
    p.add_argument("--json", default="", help="JSON lines file (default: WORK/results.jsonl)")
    p.add_argument("--doc", default=str(HERE.parent / "docs" / "benchmarks.md"), help="'' to skip writing it")
    p.add_argument("--table", default="", help="only print (and write) the table of this results file")
    a = p.parse_args(argv)
    unknown = [x for x in a.peers.split(",") if x not in PEERS]
    if unknown:
        p.error(f"--peers {','.join(unknown)}: the peers are {','.join(PEERS)}")
    return a


# -- the peers ---------------------------------------------------------------------------------------------------------
def run_peer(a, peer: str, batch: int, spec: dict, files) -> dict:
    spec = {**spec, "prompts": spec["prompts"][:batch]}
    path = Path(a.work) / f"spec-{peer}-{batch}-{spec.get('hf_gpu_share', '')}-{spec.get('kv', '')}.json"
    path.write_text(json.dumps(spec))
    r = capped(a, f"{peer}-{batch}", [sys.executable, HERE / "peers_child.py", peer, path], dict(os.environ), files)
    r.pop("gpu_samples", None)
    out = r.pop("stdout").strip().splitlines()
    if r["status"] == "failed" and r["rc"] == OVER_CAP:
        r["status"] = "over the GPU cap"
    if r["status"] == "ok":
        r.update(json.loads(out[-1]))
    else:   # what it got done before it died
        steps = [s for s in r["stages"] if s["stage"] == "step"]
        pre = next((s for s in r["stages"] if s["stage"] == "prefilled"), None)
        over = next((s for s in r["stages"] if s["stage"] == "over-cap"), None)
        if over:
            r["gpu_peak"] = over["gpu_peak"]
        if pre:
            r.update(prefill_s=pre["seconds"], tokens=[pre["token"]] + [s["token"] for s in steps])
        r["steps"] = [s["seconds"] for s in steps]
    steps = r.get("steps") or []
    if steps:
        r["s_per_step"] = statistics.median(steps)
        r["decode_tps"] = batch * len(steps) / sum(steps)
    r.pop("stages")
    if spec.get("hf_gpu_share") is not None and r.get("gpu_share") is None and "devices" not in r:
        r["gpu_share"] = spec["hf_gpu_share"]   # a child that died before it reported the share it ran with
    if spec.get("kv"):
        r.setdefault("kv", spec["kv"])
    return {"peer": peer, "batch": batch, **r}

def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in ("streamweights", "mlx", "mlx-lm", "llama-cpp-python", "transformers", "accelerate", "torch", "gguf"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def machine() -> str:
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), "?")
    mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    gpu, core = gpu_name(), blas()
    return (f"{os.cpu_count()} x {cpu}, {mem / 2**30:.0f} GiB RAM" + (f", OpenBLAS's {core} kernels" if core else "")
            + (f", {gpu}" if gpu else ""))


def blas() -> str:
    """The OpenBLAS kernels spill's processes run: a child's, with OpenBLAS preloaded as spill preloads it."""
    code = "from tests.machine import blas_core; print(blas_core())"
    done = subprocess.run([sys.executable, "-c", code], env=preload_env(), capture_output=True, text=True, timeout=60,
                          cwd=HERE.parent)
    return done.stdout.strip()


def agree_with_text(folder: Path, results: list[dict], eos: list[int]) -> None:
    """Row 0 of each spill run against the reference peer's greedy tokens up to its first EOS (spill stops there),
    through spill's own tokenizer's decode."""
    ref = reference([r for r in results if "peer" in r])
    spills = [r for r in results if r.get("peer") == "spill" and r.get("text0") is not None]
    if ref and spills:
        from spill.tokenizer_worker.core import TokenizerCore
        tok = TokenizerCore(folder).tokenizer
        tokens = ref["tokens"][:next((i + 1 for i, t in enumerate(ref["tokens"]) if t in eos), len(ref["tokens"]))]
        for r in spills:
            r["agree"] = text_agreement(r["text0"], tokens, lambda ids: tok.decode(ids, skip_special_tokens=True))


def plan(a, rows: int, gpu: bool) -> list[dict]:
    """The runs in order: spill once per configuration (each again at --spill-cap, before llama.cpp), then each
    peer at each of its batches (none above the rows there are), llama.cpp at each KV type, accelerate at each
    share of the GPU cap."""
    wanted, configs = a.peers.split(","), spill_configs(a.spill_args, a.spill_configs)
    spill = [{"peer": "spill", "batch": min(a.spill_rows, rows), "args": c} for c in configs] if "spill" in wanted else []
    out = list(spill)
    for peer in ("mlx-lm", "accelerate", "llama.cpp"):
        if peer in wanted:
            batches = {"mlx-lm": a.mlx_batches, "accelerate": a.hf_batches}.get(peer) or a.batches
            batches = list(dict.fromkeys(min(int(b), rows) for b in batches.split(",")))
            shares = a.hf_gpu_share.split(",") if peer == "accelerate" and gpu else [""]
            kvs = a.llama_kv.split(",") if peer == "llama.cpp" else [""]
            out += [{"peer": peer, "batch": b, "share": s, "kv": kv} for kv in kvs for s in shares for b in batches]
    if a.spill_cap:
        at = next((i for i, r in enumerate(out) if r["peer"] == "llama.cpp"), len(out))
        out[at:at] = [{**r, "cap": a.spill_cap} for r in spill]
    return out


def rows_and_ids(a, folder: Path) -> tuple[list[dict], list[list[int]], dict]:
    """spill's input lines, the ids every peer is fed, and what the head line says of them."""
    if not a.tier:
        lines, ids = random_rows(folder, max(a.spill_rows, *map(int, a.batches.split(","))), a.prompt, a.new)
        return lines, ids, {"prompt": a.prompt}
    lines, sources = tier_lines(a.tier.split(","), a.rows, a.new)
    ids = token_ids(folder, write_lines(lines, Path(a.work) / "rows.jsonl"))
    return lines, ids, {"prompt": lengths_line(ids), "tiers": a.tier, "rows": len(lines), "sources": sources}


def main() -> None:
    a = parse()
    if a.table:
        lines = table([json.loads(x) for x in Path(a.table).read_text().splitlines()])
        print("\n".join(lines))
        return write_doc(Path(a.doc), lines, a.marker) if a.doc else None
    from peers_gguf import convert
    Path(a.work).mkdir(parents=True, exist_ok=True)
    out = Path(a.json or Path(a.work) / "results.jsonl")
    folder = Path(a.model) if a.model else model_folder(a)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"--model {folder}: no config.json there; give a model folder (e.g. `spill import-gguf`'s)")
    config = json.loads((folder / "config.json").read_text())
    shards = sorted(folder.glob("*.safetensors"))
    gguf = Path(a.models or a.work) / f"{folder.name}.gguf"
    wanted = a.peers.split(",")
    if "llama.cpp" in wanted and not gguf.exists():
        print(f"converting {folder} to {gguf} ...", flush=True)
        convert(folder, gguf)
    size = sum(f.stat().st_size for f in shards)
    if parse_size(a.cap) >= size:
        print(f"note: the cap {a.cap} is not below the model's {size / 2**30:.2f} GiB", flush=True)
    lines, ids, prompts = rows_and_ids(a, folder)
    eos = eos_ids(folder)
    files = shards + ([gguf] if gguf.exists() else [])
    head = {"run": "peers", "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "cap": parse_size(a.cap), "model": folder.name, "model_bytes": size, **prompts, "new": a.new,
            "cold_gbps_before": read_all(shards)}
    gpu_cap = parse_size(a.gpu_cap or a.cap) if gpu_name() else None
    if gpu_cap:
        head["gpu_cap"] = gpu_cap
    results = [head]
    out.write_text(json.dumps(head) + "\n")
    print(f"model {size / 1e9:.2f} GB, cap {a.cap}, cold read {head['cold_gbps_before']:.2f} GB/s", flush=True)
    stored = (config.get("torch_dtype") or config.get("dtype") or a.dtype) if a.model else a.dtype
    spec = {"model": str(folder), "gguf": str(gguf), "prompts": ids, "new": a.new, "threads": a.threads,
            "offload": str(Path(a.work) / "offload"), "gpu_cap": gpu_cap, "eos": eos,
            "pad": config.get("pad_token_id") if config.get("pad_token_id") is not None else eos[0],
            "hf_dtype": stored if gpu_cap else "float32"}   # computed as spill computes: stored on a GPU, f32 on a CPU
    for n, step in enumerate(plan(a, len(lines), bool(gpu_cap))):
        peer, b, cap = step["peer"], step["batch"], step.get("cap", "")
        name = " ".join(x for x in (peer, step.get("args") and " ".join(step["args"]), step.get("kv") and f"KV {step['kv']}") if x)
        print(f"{name} at batch {b}{f' under {cap}' if cap else ''} ...", flush=True)
        r = run_spill(a, folder, lines[:b], files, cap, step["args"], n) if peer == "spill" else run_peer(
            a, peer, b, {**spec, **({"hf_gpu_share": float(step["share"])} if step["share"] else {}),
                         **({"kv": step["kv"]} if step["kv"] else {})}, files)
        results.append(r)
        with open(out, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"  {r['status']}: " + (f"{r['s_per_step']:.2f} s/step, {r['decode_tps']:.1f} tok/s at batch {r['batch']}"
                                      if "decode_tps" in r else f"after {r['wall_s']} s ({r.get('last_stage')})"), flush=True)
    agree_with_text(folder, results, eos)
    results.append({"run": "peers-end", "cold_gbps_after": read_all(shards), "versions": versions()})
    tmp = out.with_suffix(".tmp")   # the lines again, spill's with their agreement, then the tail
    tmp.write_text("".join(json.dumps(r) + "\n" for r in results))
    tmp.replace(out)
    lines = table(results)
    print("\n".join(lines))
    print(f"results: {out}")
    if a.doc:
        write_doc(Path(a.doc), lines, a.marker)


if __name__ == "__main__":
    main()
