"""The peers table from `peers.py`'s results, and writing it into docs/benchmarks.md between its markers."""

import json
from pathlib import Path

MIB = 2**20


def child_stages(err: str) -> dict:
    """A peer child's stderr: its stage lines, the last stage it reached ("over-cap" says why it ended, not how
    far it got) and its last six other lines."""
    stages = [json.loads(x) for x in err.splitlines() if x.startswith('{"stage"')]
    reached = [x["stage"] for x in stages if x["stage"] != "over-cap"]
    return {"stderr_tail": [x for x in err.splitlines() if not x.startswith('{"stage"')][-6:],
            "last_stage": reached[-1] if reached else None, "stages": stages}


def agreement(tokens: list[int] | None, ref: list[int] | None) -> str:
    """How many of row 0's greedy tokens equal the reference's, and where they first differ."""
    if not tokens or not ref:
        return "-"
    n = min(len(tokens), len(ref))
    return _agreed(next((i for i in range(n) if tokens[i] != ref[i]), n), n)


def _agreed(same: int, n: int) -> str:
    return f"{same}/{n}" if same == n else f"first {same}/{n}"


def text_agreement(text: str | None, ref: list[int] | None, decode) -> str:
    """agreement() for a peer that wrote text (spill's output file): the most of the reference's tokens whose
    text starts it (its ids are not re-encoded: random weights' text need not round-trip)."""
    if text is None or not ref:
        return "-"
    return _agreed(next((k - 1 for k in range(1, len(ref) + 1) if not text.startswith(decode(ref[:k]))), len(ref)),
                   len(ref))


def fmt(x: float | None, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if x else "-"


def table(results: list[dict]) -> list[str]:
    head, tail = results[0], results[-1]
    runs = [r for r in results if "peer" in r]
    gbps = (head["cold_gbps_before"] + tail.get("cold_gbps_after", head["cold_gbps_before"])) / 2
    roof = head["model_bytes"] / (gbps * 1e9)   # one read of the model from disk, cold
    ref = next((r.get("tokens") for r in runs if r["peer"] == "accelerate" and r.get("tokens")), None)
    v = tail.get("versions") or head.get("versions") or {}
    out = [f"Run {head['time']} on {head['machine']}; memory cap {head['cap'] / 2**30:.2f} GiB (child cgroup, page "
           f"cache charged); model {head['model']}, {head['model_bytes'] / 1e9:.2f} GB; prompt {head['prompt']} "
           f"tokens, {head['new']} new, greedy; cold read {head['cold_gbps_before']:.2f} GB/s before, "
           f"{tail.get('cold_gbps_after', float('nan')):.2f} after (one model read: {roof:.2f} s)."
           + (f" GPU memory capped at {head['gpu_cap'] / 2**30:.2f} GiB a peer (torch's allocator refuses past it; "
              "MLX's peak is checked); GPU peak is MLX's or torch's arrays at their most, GPU in use the device's "
              "memory in use above idle (nvidia-smi: the CUDA context and the allocators' caches too)."
              if head.get("gpu_cap") else ""),
           "Versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x) + "; not installed: "
           + (", ".join(k for k, x in v.items() if not x) or "none") + ".", "",
           "| peer | batch | outcome | s/step | decode tok/s | x roofline | prefill s | cgroup peak MiB | RSS peak MiB "
           "| GPU peak MiB | GPU in use MiB | row 0 tokens = accelerate's |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        step = r.get("s_per_step")
        io = r["bytes_per_pass"] / (gbps * 1e9) if r.get("bytes_per_pass") else roof
        outcome = r["status"] if r["status"] != "ok" else "ok"
        if r["status"] == "timeout":
            done = f"{r['passes']} passes" if r["peer"] == "spill" else f"{len(r.get('steps') or [])} steps"
            outcome += f" (>{r['wall_s']:.0f} s, {done} done)"
        elif r["status"] in ("oom-killed", "failed", "over the GPU cap"):
            when = {"loaded": "in prefill", "prefilled": "after prefill", "step": "decoding"}.get(r.get("last_stage"), "at load")
            outcome += f" {when}" if r["peer"] != "spill" else ""
        tps, pre = r.get("decode_tps"), r.get("prefill_s")
        peak, rss, gpu, used = r.get("cgroup_peak"), r.get("maxrss"), r.get("gpu_peak"), r.get("gpu_used_peak")
        passes = f" ({r['gpu_used_passes'] // MIB} in its passes)" if r.get("gpu_used_passes") is not None else ""
        agree = "reference" if r["peer"] == "accelerate" else r.get("agree") or agreement(r.get("tokens"), ref)
        name = r["peer"] + (f" (cap {r['cap'] / 2**30:.2f} GiB)" if r.get("cap") else "") + (
            f" (weights {r['gpu_share']:.2f} of the GPU cap)" if r.get("gpu_share") else "")
        every = f" ({r['decode_tps_all']:.1f} every pass)" if r.get("decode_tps_all") else ""
        out.append(f"| {name} | {r['batch']} | {outcome} | {fmt(step)} | {fmt(tps, 1)}{every} | "
                   f"{fmt(step and step / io)} | {fmt(pre, 1)} | {peak // MIB if peak else '-'} | "
                   f"{rss // MIB if rss else '-'} | {gpu // MIB if gpu else '-'} | {used // MIB if used else '-'}{passes} | {agree} |")
    out += ["", verdict([r for r in runs if not r.get("cap")])]
    for r in runs:
        if r.get("cap") and r.get("decode_tps"):
            out.append(f"At its own cap of {r['cap'] / 2**30:.2f} GiB ({'above' if r['cap'] >= head['model_bytes'] else 'below'} "
                       f"the model's size) spill decoded {r['decode_tps']:.1f} tok/s at batch {r['batch']}.")
    return out


def verdict(runs: list[dict]) -> str:
    peers = [r for r in runs if r["peer"] != "spill" and r.get("decode_tps")   # steps timed, finished or not,
             and r["status"] != "over the GPU cap"]                           # within the cap
    spill = next((r for r in runs if r["peer"] == "spill"), None)
    best = max(peers, key=lambda r: r["decode_tps"], default=None)
    share = f", weights {best['gpu_share']:.2f} of the GPU cap" if best and best.get("gpu_share") else ""
    line = (f"Best peer: {best['peer']} at batch {best['batch']}{share}, {best['decode_tps']:.1f} tok/s ({best['status']}). " if best
            else "No peer finished at this cap. ")
    if spill is None:
        return line + "spill was not run."
    if spill["status"] == "over the GPU cap":
        return line + f"spill held {spill['gpu_peak'] / 2**30:.2f} GiB on the GPU, over the cap: no figure."
    if not spill.get("decode_tps"):
        why = spill.get("first_error") or " ".join(spill.get("stdout_tail") or []) or spill["status"]
        return line + f"spill did not decode at this cap ({spill['status']}): {why}"
    ratio = f"{spill['decode_tps'] / best['decode_tps']:.2f}x the best peer" if best else "no peer to compare"
    return line + f"spill: {spill['decode_tps']:.1f} tok/s at batch {spill['batch']}, {ratio} (goal: >= 2x)."


def write_doc(doc: Path, lines: list[str], marker: str = "peers") -> None:
    """Replace what is between the `marker` markers (the section is appended once where they are missing)."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    body = "\n".join(lines)
    if begin in text and end in text:
        pre, rest = text.split(begin, 1)
        text = pre + begin + "\n" + body + "\n" + end + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n## spill against its peers under a memory cap (issue 12)\n\n"
                                    f"{begin}\n{body}\n{end}\n")
    doc.write_text(text)
