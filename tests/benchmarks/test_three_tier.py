"""The three-tier job generator, on a small copy of the reference data's formats."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("three_tier", ROOT / "benchmarks" / "three_tier.py")
three_tier = importlib.util.module_from_spec(spec)
spec.loader.exec_module(three_tier)


def fake_data(tmp_path: Path) -> Path:
    words = [f"w{i}" for i in range(3000)]
    with open(tmp_path / "gsm8k_test.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"question": " ".join(words[i:i + 10 + 2 * i]), "answer": "#### 1"}) + "\n")
    for name in ("arena_hard_v2.0_question.jsonl", "arena_hard_v0.1_question.jsonl"):
        with open(tmp_path / name, "w") as f:
            for i in range(0, 3000, 300):
                f.write(json.dumps({"uid": str(i), "prompt": " ".join(words[i:i + 300])}) + "\n")
    (tmp_path / "mt_bench_question.jsonl").write_text(json.dumps({"turns": ["one two", "three"]}) + "\n")
    return tmp_path


def test_three_tiers_in_file_order_with_the_longest_last_and_their_token_sizes(tmp_path):
    count = lambda text: len(text.split())        # one token a word
    rows = three_tier.make_rows(10, count, fake_data(tmp_path))
    tiers = [r["custom_id"].split("-")[0] for r in rows]
    assert tiers == ["short"] * 4 + ["summarize"] * 3 + ["doc_qa"] * 3
    sizes = {t: [count(r["body"]["messages"][0]["content"]) for r in rows if r["custom_id"].startswith(t)]
             for t in ("short", "summarize", "doc_qa")}
    assert all(35 <= n <= 55 for n in sizes["short"])
    assert all(410 <= n <= 420 for n in sizes["summarize"])
    assert all(880 <= n <= 900 for n in sizes["doc_qa"])
    assert len({r["body"]["messages"][0]["content"] for r in rows if r["custom_id"].startswith("doc_qa")}) == 3
    assert all(r["body"]["max_tokens"] == 128 and r["url"] == "/v1/chat/completions" for r in rows)
