"""A three-tier job like the reference run's, as a naive user would write it: short questions first,
then summaries, then document QA last (the longest tier as one block at the end of the file).

    python benchmarks/three_tier.py OUT.jsonl [--rows 240] [--tokenizer MODEL_FOLDER] [--data DIR]

    tier       prompt tokens   built from (the eval prompts in --data, see its MANIFEST.md)
    short      ~45             GSM8K test questions, in file order, those of 35-55 tokens
    summarize  ~420            "Summarize ..." + a document cut from the arena-hard and MT-Bench prompts
    doc_qa     ~900            a longer document from the same text + a GSM8K question about it

Every row asks for max_tokens 128. Token counts use the model's tokenizer.json when --tokenizer is
given (the factory's tokenizers are trained on other text, so sizes are counted, not guessed), else
4 characters a token.
"""

import argparse
import json
from pathlib import Path

DATA = Path("/work/shared/reference-data/eval_prompts")
TIERS = (("short", 45), ("summarize", 420), ("doc_qa", 900))
MAX_TOKENS = 128
STRIDE = 211                    # words between the starts of two rows' documents


def questions(data: Path) -> list[str]:
    return [json.loads(line)["question"] for line in open(data / "gsm8k_test.jsonl")]


def corpus(data: Path) -> list[str]:
    """The words of every arena-hard and MT-Bench prompt, in file order."""
    texts = []
    for name in ("arena_hard_v2.0_question.jsonl", "arena_hard_v0.1_question.jsonl"):
        texts += [json.loads(line)["prompt"] for line in open(data / name)]
    texts += [t for line in open(data / "mt_bench_question.jsonl") for t in json.loads(line)["turns"]]
    return " \n\n ".join(texts).split(" ")


def document(words: list[str], start: int, tokens: int, count) -> str:
    """The longest run of words from `start` (wrapping) whose token count stays within `tokens`."""
    lo, hi = 1, tokens * 2
    text = lambda n: " ".join(words[(start + k) % len(words)] for k in range(n)).strip()
    while lo < hi:                          # the largest word count that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(text(mid)) <= tokens else (lo, mid - 1)
    return text(lo)


def make_rows(n: int, count, data: Path = DATA) -> list[dict]:
    """n rows in three tiers (the remainder goes to the short tier), longest tier last."""
    qs, words = questions(data), corpus(data)
    short = [q for q in qs if 35 <= count(q) <= 55]
    sizes = [n - 2 * (n // 3), n // 3, n // 3]
    rows = []
    for (tier, target), size in zip(TIERS, sizes):
        for i in range(size):
            if tier == "short":
                text = short[i % len(short)]
            elif tier == "summarize":
                head = "Summarize the following text in three sentences.\n\n"
                text = head + document(words, i * STRIDE, target - count(head), count)
            else:
                q = qs[(i * 7) % len(qs)]
                head, tail = "Read the document, then answer the question after it.\n\n", f"\n\nQuestion: {q}"
                text = head + document(words, (i + 1000) * STRIDE, target - count(head + tail), count) + tail
            rows.append({"custom_id": f"{tier}-{i:04d}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "spill", "max_tokens": MAX_TOKENS,
                                  "messages": [{"role": "user", "content": text}]}})
    return rows


def counter(tokenizer_folder: str | None):
    if not tokenizer_folder:
        return lambda text: max(1, len(text) // 4)
    from tokenizers import Tokenizer
    path = Path(tokenizer_folder) / "tokenizer.json"
    if not path.is_file():
        raise SystemExit(f"--tokenizer {tokenizer_folder}: expected a folder with tokenizer.json, found none; "
                         "pass the model folder the job will run on")
    tok = Tokenizer.from_file(str(path))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--rows", type=int, default=240)
    p.add_argument("--tokenizer", default=None, help="a model folder whose tokenizer.json counts tokens")
    p.add_argument("--data", type=Path, default=DATA)
    a = p.parse_args()
    rows = make_rows(a.rows, counter(a.tokenizer), a.data)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{a.out}: {len(rows)} rows")


if __name__ == "__main__":
    main()
