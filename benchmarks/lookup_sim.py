"""Prompt lookup replayed on greedy outputs: tokens a row advances per pass for k = 1..6 drafts.

    python benchmarks/lookup_sim.py --ids rows.jsonl                       # {"prompt": [ids], "output": [ids]}
    python benchmarks/lookup_sim.py INPUT.jsonl OUTPUT.jsonl --tokenizer MODEL_FOLDER   # a `spill run` job

Each row replays its output as the model generated it (greedy: verification keeps a draft exactly where it
equals the next output token): a pass proposes up to k drafts from `streamer/lookup.py`, keeps the longest
prefix equal to the output and one token more. Three sources, reported apart:

    prompt   the row's prompt alone
    row      its prompt and its output so far
    job      and the finished outputs of the rows before it in the file (a batch job's shared templates)

A job's rows are joined by custom_id; the prompt is tokenized as the job's tokenizer did (its chat
template), the output text re-tokenized (ids may differ from the generated ones where a text has two
tokenizations). The tier is the custom_id up to its first "-" (three_tier.py names rows so).
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

from spill.streamer.lookup import History, Outputs

SOURCES = ("prompt", "row", "job")


def replay(prompt: list[int], output: list[int], k: int, source: str = "row", outputs: Outputs | None = None) -> int:
    """Passes a row takes to give `output` with up to k lookup drafts a pass."""
    history = History(prompt, index_output=source != "prompt")
    done = passes = 0
    while done < len(output):
        drafts = history.propose(k, outputs if source == "job" else None)
        kept = 0
        while kept < len(drafts) and done + kept < len(output) and drafts[kept] == output[done + kept]:
            kept += 1
        step = min(kept + 1, len(output) - done)
        history.extend(output[done:done + step])
        done, passes = done + step, passes + 1
    return passes


def simulate(rows: list[dict], ks=range(1, 7)) -> dict:
    """{tier: {(source, k): tokens per pass}} for rows {"prompt", "output", "tier"}, and "all" over every row."""
    tokens: dict[str, int] = defaultdict(int)
    passes: dict[tuple, int] = defaultdict(int)
    for r in rows:
        tokens[r.get("tier", "all")] += len(r["output"])
    for source in SOURCES:
        for k in ks:
            shared = Outputs()
            for r in rows:
                n = replay(r["prompt"], r["output"], k, source, shared)
                passes[r.get("tier", "all"), source, k] += n
                shared.add(r["output"])
    out = {tier: {(s, k): tokens[tier] / max(passes[tier, s, k], 1) for s in SOURCES for k in ks} for tier in tokens}
    if len(out) > 1:
        every = sum(tokens.values())
        out["all"] = {(s, k): every / max(sum(passes[t, s, k] for t in tokens), 1) for s in SOURCES for k in ks}
    return out


def table(result: dict, rows: list[dict], ks=range(1, 7)) -> str:
    counts = defaultdict(int)
    for r in rows:
        counts[r.get("tier", "all")] += 1
    counts["all"] = len(rows)
    lines = ["| tier | rows | source | " + " | ".join(f"k={k}" for k in ks) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in ks) + " |"]
    for tier, by in result.items():
        for s in SOURCES:
            lines.append(f"| {tier} | {counts[tier]} | {s} | " + " | ".join(f"{by[s, k]:.2f}" for k in ks) + " |")
    return "\n".join(lines)


def from_ids(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in rows:
        if not isinstance(r.get("prompt"), list) or not isinstance(r.get("output"), list):
            raise SystemExit(f"{path}: each line needs \"prompt\" and \"output\" as lists of token ids")
    return rows


def from_job(inputs: Path, outputs: Path, model: str) -> list[dict]:
    """A job's rows as the model's tokenizer gives them: the prompt as the job encoded it, the output re-encoded."""
    from spill.messages import RowRequest
    from spill.tokenizer_worker.core import TokenizerCore
    core = TokenizerCore(model)
    bodies = {}
    for line in inputs.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            bodies[r["custom_id"]] = r.get("body", r)
    rows = []
    for line in outputs.read_text().splitlines():
        out = json.loads(line) if line.strip() else {}
        body, choice = bodies.get(out.get("custom_id")), ((out.get("response") or {}).get("body") or {}).get("choices")
        if body is None or not choice:
            continue
        text = choice[0].get("message", {}).get("content") if "message" in choice[0] else choice[0].get("text")
        request = RowRequest("chat", 1, messages=body["messages"]) if "messages" in body else \
            RowRequest("completion", 1, prompt=body["prompt"])
        rows.append({"prompt": core.encode(request), "tier": out["custom_id"].split("-")[0],
                     "output": core.tokenizer.encode(text or "", add_special_tokens=False)})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input", nargs="?", type=Path, help="the job's input JSONL")
    p.add_argument("output", nargs="?", type=Path, help="its output JSONL (spill run -o)")
    p.add_argument("--tokenizer", help="the model folder the job ran on")
    p.add_argument("--ids", type=Path, help="rows as token ids instead: {\"prompt\": [...], \"output\": [...]}")
    a = p.parse_args(argv)
    if a.ids:
        rows = from_ids(a.ids)
    elif a.input and a.output and a.tokenizer:
        rows = from_job(a.input, a.output, a.tokenizer)
    else:
        p.error("give --ids FILE, or INPUT OUTPUT --tokenizer MODEL")
    print(f"{len(rows)} rows, {sum(len(r['output']) for r in rows)} output tokens; tokens per pass by source:")
    print(table(simulate(rows), rows))


if __name__ == "__main__":
    main()
