"""The prompt lookup replay: passes a greedy output takes with lookup drafts, by source."""

import importlib.util
import json
from pathlib import Path

from spill.messages import RowRequest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("lookup_sim", ROOT / "benchmarks" / "lookup_sim.py")
lookup_sim = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lookup_sim)

PROMPT = list(range(10, 40))


def test_an_output_that_copies_its_prompt_takes_k_plus_one_tokens_a_pass():
    """The first token has nothing to follow; after it, every pass keeps its 4 drafts and adds one."""
    output = PROMPT[:21]
    assert lookup_sim.replay(PROMPT, output, 4) == 1 + 4
    assert lookup_sim.replay(PROMPT, list(range(50, 70)), 4) == 20   # nothing in common: one token a pass


def test_the_sources_apart_the_rows_own_output_and_the_jobs():
    loop = [7, 8, 9] * 6                       # a row falling into a loop: its own output drafts it
    assert lookup_sim.replay([1, 2], loop, 3, "prompt") == 18
    assert lookup_sim.replay([1, 2], loop, 3, "row") < 18
    shared = lookup_sim.Outputs()
    shared.add([1, 2, 5, 6, 40, 41])
    assert lookup_sim.replay([1, 2], [5, 6, 40, 41], 3, "job", shared) == 1   # another row gave the same answer
    assert lookup_sim.replay([1, 2], [5, 6, 40, 41], 3, "row", shared) == 4


def test_the_table_from_a_file_of_ids(tmp_path, capsys):
    rows = [{"prompt": PROMPT, "output": PROMPT[:12], "tier": "edit"},
            {"prompt": [1, 2, 3], "output": [4, 5, 6, 7], "tier": "open"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lookup_sim.main(["--ids", str(path)])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "2 rows, 16 output tokens; tokens per pass by source:"
    assert "| open | 1 | row | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 |" in out
    # 12 tokens: the first alone (the prompt's last token never came before), then k + 1 a pass
    assert "| edit | 1 | row | 1.71 | 2.40 | 3.00 | 3.00 | 4.00 | 4.00 |" in out


def test_a_jobs_rows_are_joined_by_custom_id_and_tokenized_as_the_job_did(make_tiny, tmp_path):
    from spill.tokenizer_worker.core import TokenizerCore
    folder = make_tiny("llama")
    text = "the cat sat on the mat and the cat sat on the mat"
    inputs, outputs = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inputs.write_text(json.dumps({"custom_id": "edit-0", "body": {"messages": [{"role": "user", "content": text}]}})
                      + "\n" + json.dumps({"custom_id": "open-0", "body": {"prompt": "hello"}}) + "\n")
    outputs.write_text(json.dumps({"custom_id": "edit-0", "response": {"body": {"choices": [
        {"message": {"role": "assistant", "content": "the cat sat"}}]}}}) + "\n"
        + json.dumps({"custom_id": "open-0", "response": None, "error": {"code": "x", "message": "y"}}) + "\n")
    rows = lookup_sim.from_job(inputs, outputs, str(folder))
    core = TokenizerCore(folder)
    assert rows == [{"prompt": core.encode(RowRequest("chat", 1, messages=[{"role": "user", "content": text}])),
                     "tier": "edit", "output": core.tokenizer.encode("the cat sat", add_special_tokens=False)}]
