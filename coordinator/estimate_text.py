"""What the estimate and a job's end say: `spill estimate`'s lines, the line `spill run` prints before its first
pass, and the end-of-job summary."""

from collections import Counter

from spill.admission.advisor import Advice
from spill.admission.schedule import TIERS
from spill.admission.simulate import Estimate


def duration(seconds: float) -> str:
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def estimate_line(est: Estimate) -> str:
    """The one line `spill run` prints before its first pass."""
    if est.shortfall:
        return "estimate: none, the memory budget cannot hold the model's fixed part (below: why, and the fix)"
    if est.stalled and not est.passes:
        return "estimate: none, no row fits the memory budget with nothing else running (the job says why)"
    if not est.passes:
        return "estimate: nothing to run" + (f", all {est.errors} rows cannot run (counted as errors)" if est.errors else "")
    ratio = est.total_seconds / est.ideal_seconds if est.ideal_seconds else float("nan")
    kv = f" with {est.kv} KV" if est.kv != "unquantized" else ""
    return (f"estimate: {duration(est.total_seconds)} in {est.passes} {est.mode} passes{kv} "
            f"(ideal {duration(est.ideal_seconds)}, {ratio:.2f}x)")


def _group_line(others: int | None) -> str:
    if others is None:
        return ("the group's own processes: not priced, no job has run with this data home yet "
                "(the first `spill run` measures them)")
    return f"the group's own processes: {others / 2**20:.0f} MiB, as the last job here measured them"


def drafts_line(est: Estimate) -> str:
    """What the estimate priced of the job's drafts; "" where it planned none (speculation off, or a pass that
    drafts nothing: compute-bound, resident)."""
    d = est.drafts
    if not d:
        return ""
    mode = "auto" if d["speculate"] == "auto" else f"up to {d['speculate']} a row"
    if "draft" in d:
        return _draft_model_lines(est, mode)
    if d["acceptance"] is None:
        return f"drafts: {mode}, none priced (no acceptance measured on this model yet)"
    return (f"drafts: {mode}, acceptance {d['acceptance']:.2f} measured on this model ({d.get('measured', 0):,} drafts), "
            f"{d['tokens_per_decode_row']:.2f} tokens a decode row a pass{_by_tier(d)}")


def _by_tier(d: dict) -> str:
    """The acceptance each prompt-length tier's rows were priced at: its own (of how many drafts), else the model's."""
    own = d.get("measured_tiers") or {}   # said where some tier has its own
    parts = [f"{t} {a:.2f}" + (f" of {own[t]:,} drafts" if t in own else " (the model's)") for t, a in (d.get("tiers") or {}).items()]
    return "; by prompt length: " + ", ".join(parts) if own else ""


def _draft_model_lines(est: Estimate, mode: str) -> str:
    """drafts_line of a job with a draft model (--draft): its acceptance, what its steps cost, and the job without it."""
    d, name = est.drafts, est.drafts["draft"]
    if not d["passes"]:   # auto planned none; a resident pass drafts nothing, as with prompt lookup
        if est.mode == "resident" or d.get("step_s") is None:
            return ""
        return (f"drafts: auto, none from the draft model {name}: a step of it costs {d['step_s']:.2f} s at "
                f"{max(round(est.rows_per_pass), 1)} rows, more than its drafts give")
    if d["acceptance"] is None:
        line = (f"drafts: {mode} from the draft model {name}, no acceptance measured with this model yet: priced as "
                "if none were accepted (an upper bound)")
    else:
        line = (f"drafts: {mode} from the draft model {name}, acceptance {d['acceptance']:.2f} measured with this model "
                f"({d.get('measured', 0):,} drafts), {d['tokens_per_decode_row']:.2f} tokens a decode row a pass{_by_tier(d)}")
    if "draft_s" not in d:
        return line
    cost = f"the draft model costs {d['draft_s']:.2f} s a drafting pass for {d['tokens_per_decode_row']:.2f} tokens a decode row"
    if "without" in d:
        loses = " (the draft loses: leave --draft out)" if d["without"] < est.total_seconds else ""
        cost += f"; without it: {duration(d['without'])}{loses}"
    return line + "\n" + cost


def format_estimate(est: Estimate, calibration: dict, advice: Advice | None = None) -> str:
    tail = calibration.get("read_tail_s")
    lines = [estimate_line(est), *([advice.line] if advice else []),
             f"calibration: {calibration['bandwidth'] / 1e9:.2f} GB/s read, overlap {calibration['overlap']:.2f}, "
             + (f"{tail:.2f} s past a read-bound pass's read, " if tail is not None else "")
             + f"refitted from {calibration['passes']} passes",
             f"{'tier':<16}{'rows':>7}{'prompt tok':>12}{'batch':>7}{'passes':>8}{'time':>10}{'ideal':>10}"]
    for t in est.tiers:
        lines.append(f"{t.name:<16}{t.rows:>7}{t.prompt_tokens:>12,}{t.batch:>7.1f}{t.passes:>8}"
                     f"{duration(t.seconds):>10}{duration(t.ideal_seconds):>10}")
    if est.shortfall:
        lines.append(est.shortfall)
    if est.kv_hint:
        lines.append(est.kv_hint)
    if est.errors:
        lines.append(f"{est.errors} rows cannot run: counted as errors, not priced")
    if line := drafts_line(est):
        lines.append(line)
    if "group_memory" in calibration:
        lines.append(_group_line(calibration["group_memory"]))
    if est.at_max_tokens:
        lines.append("output lengths are unknown before the run: every row is priced at its max_tokens")
    if est.stalled:
        lines.append("some rows never fit the memory budget with nothing else running: they are not priced")
    return "\n".join(lines)


def summary(estimate_s: float | None, actual_s: float, finishes: list[str], lengths: list[int], passes: int,
            kv: str = "unquantized", drafts: dict | None = None, draft: str = "", tiers: dict | None = None) -> dict:
    """The end-of-job figures: estimate against actual, finish reasons, output lengths, rates; `drafts`: decode rows
    summed over passes and the draft tokens proposed and accepted; `draft`: the draft model's folder (--draft);
    `tiers`: {prompt-length tier: [drafts proposed, accepted]} of its rows."""
    lengths, d = sorted(lengths), drafts or {}
    spec = {"proposed": d["proposed"], "accepted": d["accepted"],
            "tokens_per_decode_row": round(1 + d["accepted"] / d["rows"], 3), "draft": draft or None,
            "tiers": {t: round(tiers[t][1] / tiers[t][0], 3) for t in TIERS if (tiers or {}).get(t, [0])[0]}} if d.get("proposed") and d.get("rows") else None
    return {"estimate_seconds": round(estimate_s, 1) if estimate_s else None, "actual_seconds": round(actual_s, 1),
            "actual_over_estimate": round(actual_s / estimate_s, 3) if estimate_s else None,
            "finish_reasons": dict(Counter(finishes)),
            "output_tokens": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]} if lengths else {},
            "passes": passes, "kv": kv, "rows_per_hour": round(len(finishes) / actual_s * 3600, 1) if actual_s > 0 else None,
            "drafts": spec}


def summary_lines(s: dict) -> list[str]:
    lines = []
    if s.get("estimate_seconds"):
        lines.append(f"took {duration(s['actual_seconds'])} against an estimate of {duration(s['estimate_seconds'])} "
                     f"({s['actual_over_estimate']:.2f}x)")
    out = s.get("output_tokens") or {}
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s.get("finish_reasons", {}).items()))
    kv = f"KV {s['kv']}, " if s.get("kv", "unquantized") != "unquantized" else ""
    lines.append(f"{s['passes']} passes, {kv}{s.get('rows_per_hour') or 0:.0f} rows/hour; finish reasons: {reasons or 'none'}"
                 + (f"; output tokens min {out['min']}, median {out['median']}, max {out['max']}" if out else ""))
    if d := s.get("drafts"):
        source = f" from the draft model {d['draft']}" if d.get("draft") else ""
        tiers = d.get("tiers") or {}   # said where the job's rows drafted in more than one tier
        by = "; accepted by prompt length: " + ", ".join(f"{t} {a:.0%}" for t, a in tiers.items()) if len(tiers) > 1 else ""
        lines.append(f"drafts{source}: {d['proposed']} proposed, {d['accepted']} accepted ({d['accepted'] / d['proposed']:.0%}); "
                     f"{d['tokens_per_decode_row']:.2f} tokens a decode row a pass{by}")
    return lines


