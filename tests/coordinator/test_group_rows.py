"""End to end: every way a row ends frees what admission reserved for it."""

import json

from spill import config

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


def test_preempted_rows_run_again_and_each_is_written_once(make_tiny, tmp_path):
    folder = make_tiny("llama")
    rows = write_input(tmp_path / "in.jsonl", 12, max_tokens=8)
    # every pass is "above the hard line": the newest row is preempted pass after pass
    spill("run", folder, tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--quiet", check=True, timeout=180,
          env={"SPILL_HARD_LINE": "0", "SPILL_GUARD_LINE": "10"})
    assert texts(read_output(tmp_path / "out.jsonl")) == resident_texts(folder, rows)
    log = (config.home() / "run" / "logs" / "admission.log").read_text().splitlines()
    passes = [json.loads(line) for line in log if '"event": "pass"' in line]
    assert sum(p["preempted"] for p in passes) > 0
    assert all({"budget", "live", "admitted", "held", "preempted"} <= p.keys() for p in passes)
