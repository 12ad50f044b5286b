"""The soak's draw and verdict (tests/chaos/soak.py runs its trials by hand): no group starts here."""

import json

from . import soak

REFERENCE = {"a": "one two", "b": "three"}


def _out(tmp_path, rows) -> object:
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps({"custom_id": cid, "response": {"body": {"choices": [{"text": text}]}}}) + "\n"
                           for cid, text in rows))
    return out


def test_a_seed_draws_the_same_trials_and_the_faults_take_turns():
    drawn = [soak.draw(7, k) for k in range(8)]
    assert drawn == [soak.draw(7, k) for k in range(8)]
    assert [t["fault"] for t in drawn] == list(soak.FAULTS) * 2
    assert drawn != [soak.draw(8, k) for k in range(8)]
    knobs = {"SPILL_TEST_CRASH_TOKENIZER", "SPILL_TEST_CRASH_ADMISSION", "SPILL_TEST_CRASH_STREAMER",
             "SPILL_WEDGE_TIMEOUT", "SPILL_TEST_DROP", "SPILL_STALL_TIMEOUT", "SPILL_TEST_ALLOC_FAIL"}
    assert all(set(t["env"]) <= knobs for t in drawn)


def test_the_verdict_is_identical_a_sentence_a_hang_or_a_defect(tmp_path):
    whole = _out(tmp_path, [("b", "three"), ("a", "one two")])
    assert soak.judge(0, "", whole, REFERENCE, hung=False)["outcome"] == "identical"
    assert soak.judge(None, "", whole, REFERENCE, hung=True)["outcome"] == "hang"
    part = _out(tmp_path, [("a", "one two")])
    said = "spill: x.safetensors changed; re-download it\n"
    assert soak.judge(1, said, part, REFERENCE, False)["outcome"] == "sentence"
    assert soak.judge(0, "", part, REFERENCE, False)["outcome"] == "defect"             # a row lost, exit 0
    assert soak.judge(1, "spill: a\nspill: b\n", part, REFERENCE, False)["outcome"] == "defect"   # not one sentence
    assert soak.judge(1, "Traceback (most recent call last):\n", part, REFERENCE, False)["outcome"] == "defect"
    twice = _out(tmp_path, [("a", "one two"), ("a", "one two"), ("b", "three")])
    assert soak.judge(0, "", twice, REFERENCE, False)["duplicated"] == 1
    wrong = _out(tmp_path, [("a", "one"), ("b", "three")])
    assert soak.judge(0, "", wrong, REFERENCE, False) | {"seconds": 0} == {
        "outcome": "defect", "exit": 0, "rows": 2, "duplicated": 0, "wrong": 1, "errors": 0, "tracebacks": 0,
        "seconds": 0}
