"""--draft at the front door: a job with a draft model writes every greedy row's text as without drafts, with drafts
accepted; it keeps its draft for --resume, runs beside quantized KV, and refuses another vocabulary in one sentence."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spill.coordinator.cli import app
from spill.errors import SpillError

from ..streamer.test_draft import _other_vocabulary
from .group_util import one_group, read_output, seed_home, spill, texts
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
    with one_group():
        said = {"off": spill("run", model, rows, "-o", out["off"], "--speculate", "off", "--new"),
                "draft": spill("run", model, rows, "-o", out["draft"], "--speculate", "4", "--draft", model, "--new")}
    for k, s in said.items():
        assert s.returncode == 0, s.stdout + s.stderr
    assert texts(read_output(out["draft"])) == texts(read_output(out["off"]))
    assert f"drafts from the draft model {model}: " in said["draft"].stdout
    jobs = {json.loads((d / "job.json").read_text())["output"]: d for d in (tmp_path / "home" / "jobs").iterdir()}
    passes = [json.loads(line) for line in (jobs[str(out["draft"])] / "passes.jsonl").read_text().splitlines()]
    assert sum(n for p in passes for _, n in p.get("accepted", [])) > 0
    # the job's estimate timed the draft model; its passes taught the pair's acceptance, not the model's own
    from spill.admission.calibration import model_key, stored_calibration
    from spill.admission.drafter import stored_drafter
    learned = stored_calibration(model)
    assert learned.counts(model_key(model))["count"] > 0 and stored_drafter(model) is not None


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
    assert said.exit_code == 0 and json.loads(said.stdout)["passes"] > 0, said.output   # the draft timed on stderr
    foreign = _other_vocabulary(model, tmp_path)
    said = runner.invoke(app, ["estimate", str(model), rows, "--draft", str(foreign)])
    assert said.exit_code == 2 and said.output.strip() == f"spill: {refusal(foreign)}"


def test_spill_estimate_prices_the_draft_models_steps_and_says_where_it_loses(make_tiny, tmp_path, monkeypatch):
    from spill.admission import calibration, drafter
    from spill.admission.passmodel import PassModel
    from spill.coordinator import estimate
    from spill.streamer.plan import load_plan
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    model = make_tiny("llama")
    plan = load_plan(model)
    # stored by hand (no probe): a pass reads for 1 s and computes a few ms; the pair accepted 9 of 12 drafts
    stored = calibration.Calibration(calibration._key_of(model, plan, None), PassModel(
        bandwidth=plan.streamed_bytes, fixed_s=1e-3, per_row_s=1e-4, per_prefill_token_s=1e-5, overlap=1.0))
    stored.observe_drafts([[0, 5]] * 3, [[0, 3]] * 3, calibration.model_key(model))
    stored.save()
    monkeypatch.setattr(estimate, "open_calibration", lambda *a, **k: calibration.Calibration.load(stored.key))

    def priced(step_s):   # the draft model's price as its probe stores it: (rows, steps, seconds)
        path = drafter.store_path(drafter.draft_key(model))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"prompt_token_s": 0.0, "timings": [[n, k, k * step_s] for n in (1, 16) for k in (1, 4)]}))
    lines = [json.dumps({"custom_id": f"r{i}", "prompt": "short question " * 3, "max_tokens": 40}) for i in range(4)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")

    def said(*extra):
        out = runner.invoke(app, ["estimate", str(model), str(tmp_path / "in.jsonl"), "--stream", "--draft", str(model),
                                  *extra])
        assert out.exit_code == 0, out.output
        return [line for line in out.stdout.splitlines() if line.startswith(("drafts: ", "the draft model "))]
    priced(2.0)   # each step twice the pass: the draft loses
    drafts, cost = said("--speculate", "4")
    assert drafts.startswith("drafts: up to 4 a row from the draft model model, acceptance 0.75 measured with this "
                             "model (12 drafts), ")
    assert cost.endswith("(the draft loses: leave --draft out)")
    assert 6.0 < float(cost.split()[4]) <= 8.0          # up to 4 steps of 2 s: fewer near a row's last token
    assert said() == ["drafts: auto, none from the draft model model: a step of it costs 2.00 s at 4 rows, more than "
                      "its drafts give"]
    priced(0.01)  # steps a hundredth of the pass: the draft wins
    (_, cost) = said("--speculate", "4")
    assert cost.startswith("the draft model costs 0.04 s a drafting pass for ") and "loses" not in cost
