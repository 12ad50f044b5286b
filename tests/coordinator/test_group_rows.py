"""End to end: every way a row ends frees what admission reserved for it."""

import json

from .group_util import read_output, resident_texts, spill, texts, write_input


def test_rows_ended_by_stop_strings_free_their_slots(make_tiny, tmp_path):
    folder = make_tiny("llama")
    rows = write_input(tmp_path / "plain.jsonl", 40, max_tokens=16)
    free = resident_texts(folder, rows)
    expected = {}
    for r in rows:   # stop at a letter the row writes after a few characters, so it ends early
        text = free[r["custom_id"]]
        stop = next(c for c in text[3:] if c.isascii() and c.isalpha())
        r["stop"] = [stop]
        expected[r["custom_id"]] = text[:text.find(stop)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spill("run", folder, tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--quiet", check=True,
          timeout=120, env={"SPILL_MAX_ROWS": "4"})
    out = read_output(tmp_path / "out.jsonl")
    assert texts(out) == expected
    assert {row["response"]["body"]["choices"][0]["finish_reason"] for row in out.values()} == {"stop"}
