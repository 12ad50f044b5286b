"""`spill estimate`: its text and JSON outputs, and inputs with bad rows."""

import json

import structlog
from typer.testing import CliRunner

from spill.admission import calibration
from spill.coordinator.cli import app
from spill.streamer.plan import load_plan

runner = CliRunner()


def _input(tmp_path, bad=True):
    lines = [json.dumps({"custom_id": f"s{i}", "prompt": "short question " * 3, "max_tokens": 8}) for i in range(6)]
    lines += [json.dumps({"custom_id": f"l{i}", "messages": [{"role": "user", "content": "word " * 300}],
                          "max_tokens": 4}) for i in range(3)]
    if bad:
        lines += ['{"custom_id": "broken", ', json.dumps({"custom_id": "neg", "prompt": "x", "max_tokens": -1}),
                  json.dumps({"custom_id": "huge", "prompt": "x", "max_tokens": 200000})]   # past the context
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_text_output_has_the_total_the_ideal_and_a_line_per_tier(make_tiny, tmp_path, fast_disk_home):
    result = runner.invoke(app, ["estimate", str(make_tiny("llama")), str(_input(tmp_path, bad=False))])
    assert result.exit_code == 0, result.output
    out = result.stdout.splitlines()
    assert out[0].startswith("estimate: ") and " streamed passes (ideal " in out[0] and out[0].endswith("x)")
    assert out[1].startswith("streamed (--stream or SPILL_STREAM), though resident would fit: ")   # the tests' default
    assert out[2].startswith("calibration: 2.00 GB/s read, overlap ")
    assert out[3].split() == ["tier", "rows", "prompt", "tok", "batch", "passes", "time", "ideal"]
    assert [line.split()[0] for line in out[4:6]] == ["short", "medium"]
    assert out[4].split()[2] == "6" and out[5].split()[2] == "3"
    assert out[-1] == "output lengths are unknown before the run: every row is priced at its max_tokens"
    assert not any("cannot run" in line for line in out)


def test_json_output_counts_bad_rows_as_errors_and_prices_the_rest(make_tiny, tmp_path, fast_disk_home):
    result = runner.invoke(app, ["estimate", str(make_tiny("llama")), str(_input(tmp_path)), "--json"])
    assert result.exit_code == 0, result.output
    est = json.loads(result.stdout)
    assert est["errors"] == 3                       # the broken line, max_tokens -1, the prompt past the context
    assert sum(t["rows"] for t in est["tiers"]) == 9
    assert est["total_seconds"] > 0 and est["ideal_seconds"] > 0 and est["priced_at_max_tokens"]
    assert est["calibration"]["bandwidth"] == 2e9
    text = runner.invoke(app, ["estimate", str(make_tiny("llama")), str(_input(tmp_path))]).stdout
    assert "3 rows cannot run: counted as errors, not priced" in text


def test_short_rows_run_at_a_larger_batch_than_the_long_rows_width_allows(make_tiny, tmp_path, fast_disk_home):
    from spill.admission import schedule
    from spill.admission.simulate import SimRow
    lines = [json.dumps({"custom_id": f"s{i}", "prompt": "short question " * 3, "max_tokens": 128}) for i in range(18)]
    lines += [json.dumps({"custom_id": f"l{i}", "prompt": "word " * 900, "max_tokens": 128}) for i in range(6)]
    path = tmp_path / "tiers.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = runner.invoke(app, ["estimate", str(make_tiny("llama")), str(path), "--memory", "48MiB", "--stream", "--json"])
    assert result.exit_code == 0, result.output
    short, long_ = json.loads(result.stdout)["tiers"]
    # one width for every row (the long rows') fitted this many rows at once in the budget
    _, _, max_batch = schedule.policy_for(load_plan(make_tiny("llama")), "48MiB", None)
    one_width = max_batch(SimRow(0, long_["prompt_tokens"] // long_["rows"], 128))
    assert short["batch"] > one_width >= long_["batch"] > 1


def test_the_jobs_estimate_leaves_the_groups_other_processes_out_of_the_kv_as_admission_does(
        make_tiny, tmp_path, fast_disk_home):
    from spill.admission import schedule
    from spill.admission.advisor import Advice
    from spill.admission.simulate import SimRow
    from spill.coordinator.estimate import JobEstimate
    folder, rows = make_tiny("llama"), [SimRow(i, 200, 64) for i in range(64)]
    alone = JobEstimate(folder, rows, 0, memory="48MiB", advice=Advice(False, ""))
    beside = JobEstimate(folder, rows, 0, memory="48MiB", advice=Advice(False, ""), others=12 * 2**20)
    policy, waiting, max_batch = schedule.policy_for(load_plan(folder), "48MiB", None, others=12 * 2**20)
    policy.offer([waiting(r) for r in rows])   # the job's rows choose the prompt allowance, as in the estimate
    assert beside.first.tiers[0].batch < alone.first.tiers[0].batch
    assert beside.first.tiers[0].batch <= max_batch(rows[0]) < alone.first.tiers[0].batch
    assert beside.first.total_seconds > alone.first.total_seconds


def test_spill_estimate_prices_the_groups_processes_as_the_last_job_here_measured_them(make_tiny, tmp_path,
                                                                                      fast_disk_home):
    from spill.coordinator import estimate
    lines = [json.dumps({"custom_id": f"r{i}", "prompt": "word " * 200, "max_tokens": 64}) for i in range(64)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    args = ["estimate", str(make_tiny("llama")), str(tmp_path / "in.jsonl"), "--memory", "48MiB", "--stream"]
    before = runner.invoke(app, args)
    assert "the group's own processes: not priced, no job has run with this data home yet" in before.stdout
    unknown = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert unknown["calibration"]["group_memory"] is None
    job = estimate.job_estimate(make_tiny("llama"), tmp_path / "none.jsonl", set(), {}, {}, structlog.get_logger(),
                                {"streamer": (1, 0)})
    job.priced(40 * 2**20)   # admission priced the job
    assert estimate.remembered_others() > 1
    estimate.remember_others(12 * 2**20)
    after = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert after["calibration"]["group_memory"] == 12 * 2**20
    assert after["tiers"][0]["batch"] < unknown["tiers"][0]["batch"]
    assert "the group's own processes: 12 MiB, as the last job here measured them" in runner.invoke(app, args).stdout


def test_a_missing_input_is_one_sentence(make_tiny, tmp_path):
    result = runner.invoke(app, ["estimate", str(make_tiny("llama")), str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("spill: ")


def test_it_says_which_mode_it_priced_and_a_resident_run_prices_no_read_after_the_first_pass(make_tiny, tmp_path,
                                                                                              monkeypatch):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPILL_STREAM", "0")
    # a disk slow enough that reading dominates, however long a busy machine's probe made compute
    monkeypatch.setattr(calibration, "read_probe", lambda files: 1e5)
    args = ["estimate", str(make_tiny("llama")), str(_input(tmp_path, bad=False))]
    resident = runner.invoke(app, args).stdout.splitlines()
    assert " resident passes (ideal " in resident[0] and resident[1].startswith("resident: the weights (")
    streamed = runner.invoke(app, args + ["--stream"]).stdout.splitlines()
    assert " streamed passes (ideal " in streamed[0] and streamed[1].startswith("streamed (--stream or SPILL_STREAM)")
    r, s = (json.loads(runner.invoke(app, args + extra + ["--json"]).stdout) for extra in ([], ["--stream"]))
    assert (r["mode"], s["mode"]) == ("resident", "streamed")
    read = load_plan(make_tiny("llama")).streamed_bytes / 1e5      # seconds to read the layers once
    assert s["total_seconds"] >= s["passes"] * read                # every pass reads them
    assert read <= r["total_seconds"] < s["total_seconds"] / 2     # only the first pass does


def test_an_estimate_where_no_row_fits_says_so_instead_of_zero_seconds():
    from spill.admission.simulate import Estimate
    from spill.coordinator.estimate import estimate_line
    stuck = Estimate(total_seconds=0.0, ideal_seconds=41.0, passes=0, tiers=[], stalled=True)
    assert estimate_line(stuck) == ("estimate: none, no row fits the memory budget with nothing else running "
                                    "(the job says why)")


def test_an_estimate_with_no_row_to_run_says_so_instead_of_a_ratio_of_nothing():
    from spill.admission.simulate import Estimate
    from spill.coordinator.estimate import estimate_line
    nothing = Estimate(total_seconds=0.0, ideal_seconds=0.0, passes=0, tiers=[], errors=3)
    assert estimate_line(nothing) == "estimate: nothing to run, all 3 rows cannot run (counted as errors)"
    assert estimate_line(Estimate(0.0, 0.0, 0, [])) == "estimate: nothing to run"   # a job whose rows are all written


def test_a_budget_below_the_models_fixed_part_is_named_by_the_estimate_with_its_fix(make_tiny, tmp_path,
                                                                                    fast_disk_home):
    args = ["estimate", str(make_tiny("llama")), str(_input(tmp_path, bad=False)), "--memory", "10MB"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output   # no estimate: `spill run` would refuse the job
    out = result.stdout.splitlines()
    assert out[0] == "estimate: none, the memory budget cannot hold the model's fixed part (below: why, and the fix)"
    why = [line for line in out if line.startswith("the budget is ")]
    assert why and why[0].endswith("before any KV cache; raise --memory or --budget-fraction, "
                                   "or use a machine with more memory"), out
    assert not any("cannot run" in line for line in out)   # the rows are fine: the budget is not
    est = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert est["passes"] == 0 and est["errors"] == 0 and est["shortfall"].startswith("the budget is ")


def test_budget_fraction_sets_the_budget_the_estimate_plans_for_as_run_does(make_tiny, tmp_path, fast_disk_home):
    args = ["estimate", str(make_tiny("llama")), str(_input(tmp_path, bad=False)), "--memory", "1GiB", "--json"]
    default, half = (json.loads(runner.invoke(app, args + extra).stdout)["advice"]
                     for extra in ([], ["--budget-fraction", "0.5"]))
    assert "the 798.7 MiB memory budget" in default and "the 512.0 MiB memory budget" in half
    bad = runner.invoke(app, args + ["--budget-fraction", "1.5"])
    assert bad.exit_code == 2 and "--budget-fraction must be above 0 and at most 1" in bad.output


def test_an_estimate_can_price_with_a_pass_model_other_than_the_stored_one(make_tiny, tmp_path, fast_disk_home):
    from dataclasses import replace
    from spill.admission.simulate import SimRow
    from spill.coordinator.estimate import estimate_rows
    folder, rows = make_tiny("llama"), [SimRow(i, 200, 64) for i in range(16)]
    stored, cal = estimate_rows(folder, rows, memory="48MiB")
    # a disk slow enough that reading is every pass's cost, however long the busy machine's probe made compute
    slow_disk = replace(calibration.open_calibration(folder).model, bandwidth=cal["bandwidth"] / 10_000)
    slow, priced = estimate_rows(folder, rows, memory="48MiB", model=slow_disk)
    assert priced["bandwidth"] == cal["bandwidth"] / 10_000 and slow.total_seconds > 2 * stored.total_seconds


def test_tiers_print_short_medium_long_whatever_the_rows_order(make_tiny, tmp_path, fast_disk_home):
    words = {"long": 900, "medium": 300, "short": 3}
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"{tier}{i}", "prompt": "word " * n, "max_tokens": 2}) + "\n"
                           for i in range(2) for tier, n in words.items()))
    out = runner.invoke(app, ["estimate", str(make_tiny("llama")), str(inp)]).stdout.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("tier "))
    assert [line.split()[0] for line in out[at + 1:at + 4]] == ["short", "medium", "long"]


def test_an_estimate_is_never_below_its_ideal_when_one_long_row_leads_its_tier(make_tiny, tmp_path, fast_disk_home):
    """Resident, a tier priced at its first row's batch: "ideal" above the estimate (0.81x, 0.58x here before)."""
    from spill.admission.passmodel import PassModel
    from spill.admission.simulate import SimRow
    from spill.coordinator.estimate import estimate_rows
    rows = [SimRow(0, 4, 1000)] + [SimRow(i, 20, 100) for i in range(1, 201)]
    model = PassModel(bandwidth=1e9, fixed_s=0.005, per_row_s=0.0005, per_prefill_token_s=0.0001, overlap=1.0)
    est, _ = estimate_rows(make_tiny("llama"), rows, memory="30MB", resident=True, model=model)
    assert est.passes and est.ideal_seconds <= est.total_seconds


def test_spill_estimate_speculate_says_what_it_priced_of_the_drafts(make_tiny, tmp_path, monkeypatch):
    from spill.admission.passmodel import PassModel
    from spill.coordinator import estimate
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    folder = make_tiny("llama")
    plan = load_plan(folder)
    # stored here by hand (no probe): a pass reads for 1 s and computes a few ms, so drafts pay
    key = calibration._key_of(folder, plan, None)
    stored = calibration.Calibration(key, PassModel(
        bandwidth=plan.streamed_bytes, fixed_s=1e-3, per_row_s=1e-4, per_prefill_token_s=1e-5, overlap=1.0))
    stored.save()
    monkeypatch.setattr(estimate, "open_calibration", lambda *a, **k: calibration.Calibration.load(key))   # 8-bit KV's too
    lines = [json.dumps({"custom_id": f"r{i}", "prompt": "short question " * 3, "max_tokens": 40}) for i in range(4)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    args = ["estimate", str(folder), str(tmp_path / "in.jsonl"), "--stream"]

    def said(*extra):
        out = runner.invoke(app, [*args, *extra])
        assert out.exit_code == 0, out.output
        return [line for line in out.stdout.splitlines() if line.startswith("drafts: ")]
    assert said() == ["drafts: auto, none priced (no acceptance measured on this model yet)"]
    stored.observe_drafts([[0, 5]] * 3, [[0, 3]] * 3)          # 9 accepted of 12 tried: 0.75
    stored.save()
    (line,) = said("--speculate", "4")
    assert line.startswith("drafts: up to 4 a row, acceptance 0.75 measured on this model (12 drafts), ")
    assert said("--speculate", "4", "--kv-bits", "8", "--kv-group-size", "32") == [line]   # quantized pools draft too
    assert said("--speculate", "off") == []
    off, on = (json.loads(runner.invoke(app, [*args, "--json", "--speculate", k]).stdout) for k in ("off", "auto"))
    assert off["drafts"] is None and on["drafts"]["acceptance"] == 0.75 and on["drafts"]["measured"] == 12
    assert on["passes"] < 0.7 * off["passes"]
    from spill.admission.advisor import Advice
    from spill.admission.simulate import SimRow
    job = estimate.JobEstimate(folder, [SimRow(i, 20, 40) for i in range(4)], 0, advice=Advice(False, ""), speculate=4)
    back = estimate.JobEstimate.from_wire(folder, json.loads(json.dumps(job.to_wire())))   # the estimate's child
    assert back.speculate == 4 and back.first.drafts == job.first.drafts and job.first.drafts["speculate"] == 4
    stored.observe_drafts([[0, 4]] * 30, [[0, 1]] * 30, prompts={0: 20})   # short prompts: 30 of 60 tried
    stored.save()
    (line,) = said("--speculate", "4")
    assert line.endswith("a pass; by prompt length: short (<=128) 0.50 of 60 drafts")


def test_a_pipelines_probe_runs_the_batch_one_process_holds_not_its_tightest_stages(make_tiny, tmp_path, monkeypatch):
    """The pass probe is one process with every layer and their KV: at the wider batch a stage holds (its layers'
    share of each row's KV) it outgrew the memory the budget priced, and was OOM-killed under a rank's cap."""
    import structlog
    from spill.admission.simulate import SimRow
    from spill.coordinator import estimate
    folder = make_tiny("llama", "float32")
    rows = [SimRow(i, 400, 200) for i in range(512)]   # more than any budget here holds
    one, two = (estimate.budget_rows(folder, rows, "24MiB", stages=n) for n in (1, 2))
    assert 0 < one < two < 512   # each stage holds its layers' share of a row's KV: more rows a pass
    probed = []
    monkeypatch.setattr(estimate, "open_calibration", lambda *a, rows=0, **kw: probed.append(rows) or 1 / 0)
    monkeypatch.setattr(estimate, "counted_rows", lambda *a: (rows, 0))
    estimate.job_estimate(folder, tmp_path / "in.jsonl", set(range(512)), {}, {"memory": "24MiB", "stages": 2},
                          structlog.get_logger(), others=0)
    assert probed == [one]
