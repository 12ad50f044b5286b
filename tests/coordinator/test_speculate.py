"""--speculate at the front door: a job with drafts writes every greedy row's text as without them, over unquantized
or quantized KV, accepts drafts on repetitive rows (sampled ones too, whose seeded text a re-run gives again), keeps its
K for --resume, and refuses a K out of range in one sentence."""

import json

import pytest
from typer.testing import CliRunner

from spill.coordinator.cli import app

from .group_util import one_group, read_output, seed_home, spill, texts

runner = CliRunner()


SAMPLED = {"r4": {"temperature": 0.05, "seed": 5}, "r5": {"temperature": 1.0, "top_k": 2, "seed": 6}}


def _input(path, n: int = 4):
    """n rows: r0..r3 greedy, r4 and r5 sampled (SAMPLED), each prompt a line repeated 3 to 6 times."""
    rows = [{"custom_id": f"r{i}", "prompt": " ".join(["the cat sat on the mat"] * (3 + i % 4)), "max_tokens": 24,
             **SAMPLED.get(f"r{i}", {})} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow   # three embedded groups, ~60 s on two cores
def test_spill_run_with_speculate_writes_the_same_text_with_drafts_accepted(make_tiny, tmp_path, monkeypatch,
                                                                             llama_calibration):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)
    model, rows = make_tiny("llama", "float32"), _input(tmp_path / "in.jsonl", 6)
    out = {}
    for k in ("off", "4", "4 again"):
        out[k] = tmp_path / f"out-{k}.jsonl"
        said = spill("run", model, rows, "-o", out[k], "--speculate", k.split()[0], "--new")
        assert said.returncode == 0, said.stdout + said.stderr
    plain, spec, again = (texts(read_output(out[k])) for k in ("off", "4", "4 again"))
    assert {c: t for c, t in spec.items() if c not in SAMPLED} == {c: t for c, t in plain.items() if c not in SAMPLED}
    assert again == spec   # sampled rows: their seeds' text, whatever lookup drafted
    jobs = {json.loads((d / "job.json").read_text())["output"]: d for d in (tmp_path / "home" / "jobs").iterdir()}
    jobs = [jobs[str(out[k])] for k in ("off", "4")]
    accepted = lambda d, rows: sum(n for line in (d / "passes.jsonl").read_text().splitlines()   # noqa: E731
                                   for row, n in json.loads(line).get("accepted", []) if row in rows)
    assert accepted(jobs[0], range(6)) == 0 and accepted(jobs[1], range(4)) > 0 and accepted(jobs[1], (4, 5)) > 0


def test_spill_run_over_quantized_kv_writes_the_same_text_with_drafts_accepted(make_tiny, tmp_path, monkeypatch,
                                                                             llama_calibration):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)
    model, rows = make_tiny("llama", "float32"), _input(tmp_path / "in.jsonl", 4)
    kv = ["--kv-bits", "8", "--kv-group-size", "32"]
    out = {k: tmp_path / f"out-{k}.jsonl" for k in ("off", "4")}
    with one_group():
        for k, path in out.items():
            said = spill("run", model, rows, "-o", path, *kv, "--speculate", k, "--new")
            assert said.returncode == 0, said.stdout + said.stderr
    assert texts(read_output(out["4"])) == texts(read_output(out["off"])) and len(texts(read_output(out["4"]))) == 4
    jobs = {json.loads((d / "job.json").read_text())["output"]: d for d in (tmp_path / "home" / "jobs").iterdir()}
    passes = [json.loads(line) for line in (jobs[str(out["4"])] / "passes.jsonl").read_text().splitlines()]
    assert sum(n for p in passes for _, n in p.get("accepted", [])) > 0


def test_speculate_is_refused_out_of_range_and_against_a_resumed_jobs_own_and_taken_with_quantized_kv(
        make_tiny, tmp_path, monkeypatch):
    from spill.coordinator.jobrun import JobRun
    from spill.coordinator.submit import prepare
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    model, rows = str(make_tiny("llama")), str(_input(tmp_path / "in.jsonl"))
    wide = runner.invoke(app, ["run", model, rows, "--speculate", "17"])
    assert wide.exit_code == 2 and "--speculate takes off, auto or a number of drafts from 1 to 16, found '17'" in wide.output
    s = prepare({"model": model, "input": rows, "speculate": 4}, {}, {}, True)
    assert s.params["speculate"] == 4 and prepare({"resume": s.job.id}, {}, {}, True).args["speculate"] == 4
    assert JobRun(s.job, s.requests, model, s.job.meta["params"]).speculate == 4   # what the group's RESET carries
    other = runner.invoke(app, ["run", "--resume", s.job.id, "--speculate", "off"])
    assert other.exit_code == 2 and f"job {s.job.id} runs with the --speculate it started with" in other.output
    quantized = prepare({"model": model, "input": rows, "speculate": 4, "kv_bits": 8, "kv_group_size": 32, "new": True},
                        {}, {}, True)
    assert (quantized.params["speculate"], quantized.params["kv_bits"], quantized.params["kv_group_size"]) == (4, 8, 32)


def test_the_default_auto_drafts_where_the_disk_is_slow_and_writes_the_same_text(make_tiny, tmp_path, monkeypatch,
                                                                                  llama_calibration):
    from spill.typed import AUTO_DRAFTS
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)
    model, rows = make_tiny("llama", "float32"), _input(tmp_path / "in.jsonl", 2)
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    out = {k: tmp_path / f"out-{k}.jsonl" for k in ("off", "auto")}
    said = {"off": spill("run", model, rows, "-o", out["off"], "--stream", "--speculate", "off", "--new"),
            # a read of 0.2 s a pass under milliseconds of math, as a big model on a Mac: drafts pay
            "auto": spill("run", model, rows, "-o", out["auto"], "--stream", "--new",
                          env={"SPILL_TEST_READ_RATE": str(size / 0.2)})}
    for k, s in said.items():
        assert s.returncode == 0, s.stdout + s.stderr
    assert texts(read_output(out["auto"])) == texts(read_output(out["off"]))
    jobs = {json.loads((d / "job.json").read_text())["params"]["speculate"]: d
            for d in (tmp_path / "home" / "jobs").iterdir()}
    passes = [json.loads(line) for line in (jobs[AUTO_DRAFTS] / "passes.jsonl").read_text().splitlines()]
    assert sum(n for p in passes for _, n in p.get("accepted", [])) > 0
    assert any(p.get("columns", 1) > 1 for p in passes) and "drafts: " in said["auto"].stdout
    assert "drafts: " not in said["off"].stdout


@pytest.mark.parametrize("text, k", [("auto", -1), ("off", 0), ("4", 4), (" AUTO ", -1), ("16", 16)])
def test_the_flag_reads_auto_off_or_a_count(text, k):
    from spill.coordinator.cli import speculate_arg
    from spill.typed import AUTO_DRAFTS
    assert speculate_arg(text) == k and AUTO_DRAFTS == -1
