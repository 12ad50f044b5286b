"""Real prompts in four kinds, as Batch JSONL for `spill run`: open questions, summarize-a-passage,
answer-from-a-document and edit-this-text (what prompt lookup and drafting are measured on).

    python benchmarks/real_prompts.py SOURCE [--out benchmarks/data]

SOURCE is a folder of the public eval files (MANIFEST of the shared reference data: FastChat's MT-Bench
questions and GPT-4 reference answers, arena-hard-auto v0.1 and v2.0, IFEval, GSM8K test). Rows are picked
in a fixed order, so the same files give the same JSONL; each custom_id names its source row.
    open.jsonl       MT-Bench first turns: writing, roleplay, stem, humanities (4 each)
    summarize.jsonl  "Summarize ..." over MT-Bench's prose reference answers; arena-hard's passage summaries
    document.jsonl   MT-Bench extraction (a passage and a question about it); arena-hard document questions
    edit.jsonl       IFEval's rewrite-this-quote prompts; GSM8K questions with every name to change
"""

import argparse
import json
from pathlib import Path

SUMMARIZE = "Summarize the following passage in three sentences.\n\n"
RENAME = "Rewrite the following text, changing every person's name to Alex and keeping every other word the same.\n\n"
ARENA_SUMMARY = ["4bf132b69be3469b", "26a29141be254ce0a7710e45face31f4"]   # a passage to summarize
ARENA_DOCUMENT = ["cd58c7967f4b446e", "83f122e920704a5a", "5db031c7ed544371", "5882af2d32934ff8",
                  "d0acf61ec58748c6", "0fa52d2ea4f74c52912eb817d248778b"]   # a document, then a question on it


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]   # not splitlines: U+2028 in text


def _row(custom_id: str, text: str, max_tokens: int) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}}


def _arena(source: Path) -> dict[str, str]:
    prompts = {}
    for name in ("arena_hard_v0.1_question.jsonl", "arena_hard_v2.0_question.jsonl"):
        for r in _lines(source / name):
            text = r.get("prompt") or r["turns"][0]["content"]
            prompts[r.get("uid") or r["question_id"]] = text
    return prompts


def build(source: Path, max_tokens: int = 256) -> dict[str, list[dict]]:
    """The four sets, by file name."""
    mt = _lines(source / "mt_bench_question.jsonl")
    answers = {r["question_id"]: r["choices"][0]["turns"][0]
               for r in _lines(source / "mt_bench_reference_answer_gpt-4.jsonl")}
    arena = _arena(source)
    open_rows = [_row(f"open-mtbench-{q['question_id']}", q["turns"][0], max_tokens)
                 for cat in ("writing", "roleplay", "stem", "humanities")
                 for q in [q for q in mt if q["category"] == cat][:4]]
    prose = [(qid, text) for qid, text in answers.items() if len(text) >= 500 and "```" not in text
             and not text.lstrip().startswith("<")]
    summarize = [_row(f"summarize-mtbench-answer-{qid}", SUMMARIZE + text, max_tokens) for qid, text in prose]
    summarize += [_row(f"summarize-arena-{uid}", arena[uid], max_tokens) for uid in ARENA_SUMMARY]
    document = [_row(f"document-mtbench-{q['question_id']}", q["turns"][0], max_tokens)
                for q in mt if q["category"] == "extraction"]
    document += [_row(f"document-arena-{uid}", arena[uid], max_tokens) for uid in ARENA_DOCUMENT]
    rewrites = [r for r in _lines(source / "ifeval_input_data.jsonl")
                if r["prompt"].lower().startswith(("rewrite the following", "rewrite the sentence", "can you rewrite"))]
    edit = [_row(f"edit-ifeval-{r['key']}", r["prompt"], max_tokens) for r in rewrites[:8]]
    edit += [_row(f"edit-gsm8k-{i}", RENAME + r["question"], max_tokens)
             for i, r in enumerate(_lines(source / "gsm8k_test.jsonl")[:8])]
    return {"open.jsonl": open_rows, "summarize.jsonl": summarize, "document.jsonl": document, "edit.jsonl": edit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, help="the folder of the eval files (eval_prompts/ of the reference data)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in build(args.source, args.max_tokens).items():
        (args.out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"{args.out / name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
