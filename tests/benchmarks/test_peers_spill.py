"""spill's runs in peers.py: its configurations of extra arguments, and its figures from a job's passes and output."""

import json

from tests.benchmarks.scripts import load

peers_spill = load("peers_spill")


def test_each_configuration_gets_the_common_arguments_and_off_means_no_drafts():
    configs = peers_spill.spill_configs("--stream", "off; --speculate auto --kv-bits 8 --kv-group-size 32")
    assert configs == [["--stream", "--speculate", "off"],
                       ["--stream", "--speculate", "auto", "--kv-bits", "8", "--kv-group-size", "32"]]
    assert peers_spill.spill_configs("--kv-bits 8", "") == [["--kv-bits", "8"]]
    assert peers_spill.spill_configs("", "") == [[]]
    assert peers_spill.kv_label(configs[1]) == "8-bit (group 32)"
    assert peers_spill.kv_label(configs[0]) == "compute dtype"


def test_spills_figures_come_from_its_passes_and_skip_the_written_records(tmp_path):
    """A job's history ends with a record of the rows written after its last pass (no pass fields): read by
    hand, it failed the run with KeyError 'prefill_tokens'."""
    from spill.coordinator import history
    lines = [{"prefill_tokens": 512, "decode_rows": 4, "seconds": 3.0, "emitted": 4, "bytes_streamed": 9, "done": 0},
             {"prefill_tokens": 0, "decode_rows": 4, "seconds": 1.0, "emitted": 4, "bytes_streamed": 9, "done": 0},
             {"prefill_tokens": 0, "decode_rows": 4, "seconds": 3.0, "emitted": 4, "bytes_streamed": 9, "done": 0},
             {"written": True, "time": 0.0, "done": 4}]
    (tmp_path / history.FILE).write_text("".join(f"{json.dumps(x)}\n" for x in lines))
    r = peers_spill.decode_figures(history.read(tmp_path))
    assert (r["batch"], r["passes"], r["s_per_step"], r["decode_tps"]) == (4, 3, 2.0, 2.0)
    assert (r["drafted"], r["accepted"]) == (0, 0)


def test_accepted_drafts_count_in_spills_tokens_a_second():
    # four rows, two of which took two drafts each in the second pass: 8 tokens in that pass, not 4
    passes = [{"prefill_tokens": 0, "decode_rows": 4, "seconds": 1.0, "emitted": 4, "bytes_streamed": 9},
              {"prefill_tokens": 0, "decode_rows": 4, "seconds": 1.0, "emitted": 8, "bytes_streamed": 9,
               "drafted": [[1, 3], [2, 3]], "accepted": [[1, 2], [2, 2]]},
              {"prefill_tokens": 0, "decode_rows": 2, "seconds": 1.0, "emitted": 2, "bytes_streamed": 9}]
    r = peers_spill.decode_figures(passes)
    assert r["decode_tps"] == 6.0 and r["decode_tps_all"] == 14 / 3
    assert (r["drafted"], r["accepted"], r["decode_tokens"]) == (6, 4, 14)


def test_spills_step_is_its_widest_decode_pass_even_where_a_prompt_pass_was_wider():
    """Drafts move rows on at prompt passes, so the widest pass may take prompts: the step is then the widest
    decode pass's, never every decode pass's (a tail of one row among them) against another run's widest."""
    passes = [{"prefill_tokens": 300, "decode_rows": 26, "seconds": 5.0, "emitted": 40, "bytes_streamed": 9},
              {"prefill_tokens": 0, "decode_rows": 25, "seconds": 1.0, "emitted": 25, "bytes_streamed": 9},
              {"prefill_tokens": 0, "decode_rows": 25, "seconds": 1.0, "emitted": 25, "bytes_streamed": 9},
              {"prefill_tokens": 0, "decode_rows": 1, "seconds": 0.5, "emitted": 1, "bytes_streamed": 9}]
    r = peers_spill.decode_figures(passes)
    assert (r["batch"], r["s_per_step"], r["decode_tps"], r["decode_tps_all"]) == (25, 1.0, 25.0, 51 / 2.5)
    assert r["widest"] == 26


def test_row_0s_text_is_read_from_a_chat_row_and_from_a_completion_row(tmp_path):
    def line(cid: str, choice: dict, tokens: int) -> str:
        return json.dumps({"custom_id": cid, "response": {"body": {"choices": [choice],
                                                                  "usage": {"completion_tokens": tokens}}}}) + "\n"
    out = tmp_path / "out.jsonl"
    out.write_text(line("r1", {"message": {"content": "other"}}, 5) + line("r0", {"message": {"content": "Hi."}}, 3)
                   + json.dumps({"custom_id": "r2", "error": {"message": "too long"}}) + "\n")
    r = peers_spill.outputs(out)
    assert (r["text0"], r["rows_ok"], r["rows_error"], r["completion_tokens"]) == ("Hi.", 2, 1, 8)
    out.write_text(line("r0", {"text": "plain"}, 1))
    assert peers_spill.outputs(out)["text0"] == "plain"
