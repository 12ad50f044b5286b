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


def reference(runs: list[dict]) -> dict | None:
    """The run whose row 0 tokens the others are compared with: accelerate's (float32 on a CPU), else the first
    llama.cpp run's."""
    for peer in ("accelerate", "llama.cpp"):
        run = next((r for r in runs if r["peer"] == peer and r.get("tokens")), None)
        if run:
            return run
    return None


def label(r: dict) -> str:
    """A run's name in the table: spill with its extra arguments, llama.cpp with its KV cache type."""
    extra = r.get("args") if r["peer"] == "spill" else f"KV {r['kv']}" if r.get("kv") else ""
    return r["peer"] + (f" ({extra})" if extra else "")


NO_BATCHED_DRAFTS = {   # what each peer offers instead, checked in its source (the versions in the header)
    "llama.cpp": "llama-cpp-python drafts (`draft_model`, prompt lookup too) only in `Llama.generate`, one sequence; "
                 "its batched `llama_decode`, used here, takes none",
    "accelerate": "transformers' assisted generation and prompt lookup refuse a batch above 1 (\"assisted generate "
                  "is only supported for batch_size = 1\")",
    "mlx-lm": "`speculative_generate_step` is one sequence and `BatchGenerator` takes no draft",
}


def no_batched_drafts(runs: list[dict]) -> str | None:
    peers = [p for p in NO_BATCHED_DRAFTS if any(r["peer"] == p for r in runs)]
    return ("No batched speculation in the peers, so none is used here: "
            + "; ".join(f"{p}: {NO_BATCHED_DRAFTS[p]}" for p in peers) + ".") if peers else None


def tokens(r: dict) -> str:
    """The tokens a run generated: spill's rows stop at EOS; a peer's run on, with where they would have stopped."""
    if r["peer"] == "spill":
        return str(r["completion_tokens"]) if r.get("completion_tokens") is not None else "-"
    if r.get("generated") is None:
        return "-"
    return f"{r['generated']} ({r['to_eos']} to EOS)" if r.get("to_eos") is not None else str(r["generated"])


def prompts(head: dict) -> str:
    if head.get("tiers"):
        return (f"{head['rows']} real prompts of the {head['tiers']} tiers, {head['prompt']}, max_tokens {head['new']}, "
                "greedy (spill's rows stop at EOS, the peers' run on)")
    return f"prompt {head['prompt']} tokens, {head['new']} new, greedy"


def fmt(x: float | None, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if x else "-"


def table(results: list[dict]) -> list[str]:
    head, tail = results[0], results[-1]
    runs = [r for r in results if "peer" in r]
    gbps = (head["cold_gbps_before"] + tail.get("cold_gbps_after", head["cold_gbps_before"])) / 2
    roof = head["model_bytes"] / (gbps * 1e9)   # one read of the model from disk, cold
    ref_run = reference(runs)
    ref = ref_run and ref_run["tokens"]
    v = tail.get("versions") or head.get("versions") or {}
    out = [f"Run {head['time']} on {head['machine']}; memory cap {head['cap'] / 2**30:.2f} GiB (child cgroup, page "
           f"cache charged); model {head['model']}, {head['model_bytes'] / 1e9:.2f} GB; {prompts(head)}; cold read {head['cold_gbps_before']:.2f} GB/s before, "
           f"{tail.get('cold_gbps_after', float('nan')):.2f} after (one model read: {roof:.2f} s)."
           + (f" GPU memory capped at {head['gpu_cap'] / 2**30:.2f} GiB a peer (torch's allocator refuses past it; "
              "MLX's peak is checked); GPU peak is MLX's or torch's arrays at their most, GPU in use the device's "
              "memory in use above idle (nvidia-smi: the CUDA context and the allocators' caches too)."
              if head.get("gpu_cap") else ""),
           "Versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x) + "; not installed: "
           + (", ".join(k for k, x in v.items() if not x) or "none") + ".", "",
           "| peer | batch | outcome | s/step | decode tok/s | tokens | x roofline | prefill s | cgroup peak MiB "
           f"| RSS peak MiB | GPU peak MiB | GPU in use MiB | row 0 tokens = {label(ref_run) if ref_run else 'accelerate'}'s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
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
        agree = "reference" if r is ref_run else r.get("agree") or agreement(r.get("tokens"), ref)
        name = label(r) + (f" (cap {r['cap'] / 2**30:.2f} GiB)" if r.get("cap") else "") + (
            f" (weights {r['gpu_share']:.2f} of the GPU cap)" if r.get("gpu_share") else "")
        every = f" ({r['decode_tps_all']:.1f} every pass)" if r.get("decode_tps_all") else ""
        out.append(f"| {name} | {r['batch']} | {outcome} | {fmt(step)} | {fmt(tps, 1)}{every} | {tokens(r)} | "
                   f"{fmt(step and step / io)} | {fmt(pre, 1)} | {peak // MIB if peak else '-'} | "
                   f"{rss // MIB if rss else '-'} | {gpu // MIB if gpu else '-'} | {used // MIB if used else '-'}{passes} | {agree} |")
    drafts = [f"{label(r)}: {r['accepted']} of {r['drafted']} drafts accepted" for r in runs if r.get("drafted")]
    out += [""] + ([no_batched_drafts(runs)] if no_batched_drafts(runs) else []) + (
        ["Drafts: " + "; ".join(drafts) + "."] if drafts else []) + [verdict([r for r in runs if not r.get("cap")])]
    for r in runs:
        if r.get("cap") and r.get("decode_tps"):
            out.append(f"At its own cap of {r['cap'] / 2**30:.2f} GiB ({'above' if r['cap'] >= head['model_bytes'] else 'below'} "
                       f"the model's size) spill decoded {r['decode_tps']:.1f} tok/s at batch {r['batch']}.")
    return out


def verdict(runs: list[dict]) -> str:
    peers = [r for r in runs if r["peer"] != "spill" and r.get("decode_tps")   # steps timed, finished or not,
             and r["status"] != "over the GPU cap"]                           # within the cap
    spills = [r for r in runs if r["peer"] == "spill"]
    best = max(peers, key=lambda r: r["decode_tps"], default=None)
    share = f", weights {best['gpu_share']:.2f} of the GPU cap" if best and best.get("gpu_share") else ""
    line = (f"Best peer: {label(best)} at batch {best['batch']}{share}, {best['decode_tps']:.1f} tok/s ({best['status']}). "
            if best else "No peer finished at this cap. ")
    if not spills:
        return line + "spill was not run."
    return line + " ".join(spill_verdict(r, best, len(spills) > 1) for r in spills)


def spill_verdict(spill: dict, best: dict | None, named: bool) -> str:
    """One spill run's figure against the best peer's; `named`: with its arguments, where several ran."""
    who = label(spill) if named else "spill"
    if spill["status"] == "over the GPU cap":
        return f"{who} held {spill['gpu_peak'] / 2**30:.2f} GiB on the GPU, over the cap: no figure."
    if not spill.get("decode_tps"):
        why = spill.get("first_error") or " ".join(spill.get("stdout_tail") or []) or spill["status"]
        return f"{who} did not decode at this cap ({spill['status']}): {why}"
    ratio = f"{spill['decode_tps'] / best['decode_tps']:.2f}x the best peer" if best else "no peer to compare"
    return f"{who}: {spill['decode_tps']:.1f} tok/s at batch {spill['batch']}, {ratio} (goal: >= 2x)."


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
