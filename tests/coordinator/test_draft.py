"""--draft at the front door: a job with a draft model writes every greedy row's text as without drafts, with drafts
accepted; it keeps its draft for --resume, runs beside quantized KV, and refuses another vocabulary in one sentence."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spill.coordinator.cli import app
from spill.errors import SpillError

from ..streamer.test_draft import _other_vocabulary
from .group_util import read_output, seed_home, spill, texts
from .test_speculate import _input

runner = CliRunner()


def test_a_draft_is_kept_with_the_job_taken_with_quantized_kv_and_refused_with_another_vocabulary(make_tiny, tmp_path,
                                                                                                    monkeypatch):
    from spill.coordinator.jobrun import JobRun
    from spill.coordinator.submit import prepare
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    model, draft, rows = str(make_tiny("llama")), str(make_tiny("llama", seed=1)), str(_input(tmp_path / "in.jsonl"))
    s = prepare({"model": model, "input": rows, "speculate": 4, "draft": draft}, {}, {}, True)
    assert s.params["draft"] == draft and prepare({"resume": s.job.id}, {}, {}, True).args["draft"] == draft
    assert JobRun(s.job, s.requests, model, s.job.meta["params"]).draft == draft   # what the group's RESET carries
    group = prepare({"model": model, "input": rows, "new": True}, {"draft": draft}, {}, True)   # `spill up --draft`
    assert group.params["draft"] == draft
    other = runner.invoke(app, ["run", "--resume", s.job.id, "--draft", model])
    assert other.exit_code == 2 and f"job {s.job.id} runs with the --draft it started with" in other.output
    foreign = _other_vocabulary(Path(model), tmp_path)
    with pytest.raises(SpillError) as err:
        prepare({"model": model, "input": rows, "draft": str(foreign), "new": True}, {}, {}, True)
    assert str(err.value) == refusal(foreign)
    quantized = prepare({"model": model, "input": rows, "draft": draft, "kv_bits": 8, "kv_group_size": 32, "new": True},
                        {}, {}, True)
    assert (quantized.params["draft"], quantized.params["kv_bits"]) == (draft, 8)   # the draft's cache unquantized
    with pytest.raises(SpillError, match="^--draft proposes the drafts --speculate carries, which is off; add"):
        prepare({"model": model, "input": rows, "draft": draft, "speculate": 0, "new": True}, {}, {}, True)


def test_spill_run_with_a_draft_writes_the_same_text_with_drafts_accepted(make_tiny, tmp_path, monkeypatch,
                                                                          llama_calibration):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)
    model, rows = make_tiny("llama", "float32"), _input(tmp_path / "in.jsonl", 2)
    out = {k: tmp_path / f"out-{k}.jsonl" for k in ("off", "draft")}
    said = {"off": spill("run", model, rows, "-o", out["off"], "--speculate", "off", "--new"),
            "draft": spill("run", model, rows, "-o", out["draft"], "--speculate", "4", "--draft", model, "--new")}
    for k, s in said.items():
        assert s.returncode == 0, s.stdout + s.stderr
    assert texts(read_output(out["draft"])) == texts(read_output(out["off"]))
    assert f"drafts from the draft model {model}: " in said["draft"].stdout
    jobs = {json.loads((d / "job.json").read_text())["output"]: d for d in (tmp_path / "home" / "jobs").iterdir()}
    passes = [json.loads(line) for line in (jobs[str(out["draft"])] / "passes.jsonl").read_text().splitlines()]
    assert sum(n for p in passes for _, n in p.get("accepted", [])) > 0


def test_the_estimate_prices_the_draft_models_weights_and_kv(make_tiny, tmp_path, monkeypatch, llama_calibration):
    from spill.admission.simulate import SimRow
    from spill.coordinator.estimate import JobEstimate, estimate_rows
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)
    folder, rows = make_tiny("llama"), [SimRow(i, 200, 64) for i in range(300)]
    plain, _ = estimate_rows(folder, rows, memory="48MiB", speculate=4)
    drafted, _ = estimate_rows(folder, rows, memory="48MiB", speculate=4, draft=str(folder))
    assert drafted.passes > plain.passes   # fewer rows a pass
    assert drafted.drafts is None or drafted.drafts["acceptance"] is None   # lookup's acceptance is not the draft's
    back = JobEstimate.from_wire(folder, JobEstimate(folder, rows[:4], 0, "48MiB", draft=str(folder)).to_wire())
    assert back.draft == str(folder)


def refusal(foreign: Path) -> str:
    return (f"--draft {foreign}: its vocabulary (32768 tokens) differs from the model's (2048 tokens); give --draft a "
            "smaller model that shares the model's tokenizer (the same family), or leave --draft out")


def test_spill_estimate_with_a_draft_prices_it_and_refuses_another_vocabulary(make_tiny, tmp_path, monkeypatch,
                                                                              llama_calibration):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)
    model, rows = make_tiny("llama"), str(_input(tmp_path / "in.jsonl"))
    said = runner.invoke(app, ["estimate", str(model), rows, "--speculate", "4", "--draft", str(model), "--json"])
    assert said.exit_code == 0 and json.loads(said.output)["passes"] > 0, said.output
    foreign = _other_vocabulary(model, tmp_path)
    said = runner.invoke(app, ["estimate", str(model), rows, "--draft", str(foreign)])
    assert said.exit_code == 2 and said.output.strip() == f"spill: {refusal(foreign)}"
