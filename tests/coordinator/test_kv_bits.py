"""--kv-bits and --kv-group-size at the front door: the estimate prices and names the KV format, a KV-bound job is
told what 8-bit KV would give, and the job keeps its format for the group and for --resume."""

import json

from typer.testing import CliRunner

from spill.admission import calibration
from spill.coordinator.cli import app

from .group_util import seed_home

runner = CliRunner()


def _tiers(tmp_path):
    lines = [json.dumps({"custom_id": f"s{i}", "prompt": "short question " * 3, "max_tokens": 128}) for i in range(18)]
    lines += [json.dumps({"custom_id": f"l{i}", "prompt": "word " * 900, "max_tokens": 128}) for i in range(6)]
    path = tmp_path / "tiers.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_estimate_prices_quantized_kv_and_tells_a_kv_bound_job_what_8_bits_give(make_tiny, tmp_path, monkeypatch,
                                                                                     llama_calibration):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)   # the session's probe: none here
    (tmp_path / "home" / "calibration" / "group.json").unlink(missing_ok=True)   # another test's group: not this one's
    monkeypatch.setattr(calibration, "read_probe", lambda files: 2e9)
    args = ["estimate", str(make_tiny("llama")), str(_tiers(tmp_path)), "--memory", "48MiB", "--stream"]
    plain = runner.invoke(app, args + ["--json"])
    eight = runner.invoke(app, args + ["--kv-bits", "8", "--kv-group-size", "32"])
    assert plain.exit_code == 0 == eight.exit_code, plain.output + eight.output
    est = json.loads(plain.stdout)
    assert est["kv"] == "unquantized" and est["kv_hint"].startswith(
        "KV-bound (priced unquantized): --kv-bits 8 (8-bit KV, group 32) would run ")
    first = eight.stdout.splitlines()[0]
    assert " streamed passes with 8-bit (group 32) KV (ideal " in first
    rows, seconds = est["kv_hint"].split(" would run ")[1].split(" rows a pass against ")[0], first.split(" in ")[0]
    assert float(rows) > 1.5 * float(est["kv_hint"].split(" rows a pass against ")[1].split(",")[0])
    assert est["kv_hint"].endswith(f", {seconds.removeprefix('estimate: ')} in all")   # the same figure both ways


def test_a_kv_format_the_model_or_mlx_cannot_take_is_one_sentence(make_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    args = ["estimate", str(make_tiny("llama")), str(_tiers(tmp_path))]
    alone = runner.invoke(app, args + ["--kv-group-size", "32"])
    assert alone.exit_code == 2 and "--kv-group-size 32 sets quantized KV's groups; add --kv-bits 8 or 4" in alone.output
    odd = runner.invoke(app, args + ["--kv-bits", "6"])
    assert odd.exit_code == 2 and "--kv-bits 6 is not one of 8, 4" in odd.output
    wide = runner.invoke(app, args + ["--kv-bits", "8"])   # group 64, head dimension 32
    assert wide.exit_code == 2 and "--kv-group-size 64 does not divide the model's head dimension 32" in wide.output
    gemma = str(make_tiny("gemma2"))   # its attention is mlx-lm's own: the streamer crashed 4 times
    said = "--kv-bits 8: gemma2's attention (soft-capped) reads the cache's keys itself, where quantized KV cannot go"
    for cmd in (["estimate", gemma, str(_tiers(tmp_path))], ["check", gemma]):
        refused = runner.invoke(app, cmd + ["--kv-bits", "8", "--kv-group-size", "32"])
        assert refused.exit_code == 2 and said in refused.output, refused.output


def test_a_job_keeps_its_kv_format_for_the_group_and_for_resume(make_tiny, tmp_path, monkeypatch):
    from spill.coordinator.jobrun import JobRun
    from spill.coordinator.submit import prepare
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    folder = str(make_tiny("llama"))
    args = {"model": folder, "input": str(_tiers(tmp_path)), "kv_bits": 4, "kv_group_size": 32}
    s = prepare(args, {}, {}, True)
    assert (s.params["kv_bits"], s.params["kv_group_size"]) == (4, 32) and s.memory["kv_bits"] == 4   # the estimate's
    again = prepare({"resume": s.job.id}, {}, {}, True)
    assert again.memory["kv_bits"] == 4 and again.memory["kv_group_size"] == 32
    other = runner.invoke(app, ["run", "--resume", s.job.id, "--kv-bits", "8", "--kv-group-size", "32"])
    assert other.exit_code == 2 and f"job {s.job.id} runs with the KV format it started with; leave --kv-bits" in other.output
    run = JobRun(s.job, s.requests, folder, s.job.meta["params"])
    assert run.kv == (4, 32) and run.kv_format == "4-bit (group 32)"
    group = prepare({**args, "kv_bits": None, "kv_group_size": None, "new": True}, {"kv_bits": 8, "kv_group_size": 32}, {}, True)
    assert group.params["kv_bits"] == 8   # `spill up --kv-bits 8`: the default of jobs that do not say
    try:
        prepare({**args, "kv_bits": 8, "kv_group_size": 64, "new": True}, {}, {}, True)
    except Exception as err:   # noqa: BLE001
        assert str(err) == "--kv-group-size 64 does not divide the model's head dimension 32; use --kv-group-size 32"
    else:
        raise AssertionError("a group size that does not divide the head dimension was taken")


def test_spill_run_with_kv_bits_runs_the_job_in_quantized_pools_through_the_front_door(make_tiny, tmp_path, monkeypatch,
                                                                                         llama_calibration):
    """`spill run --kv-bits 8` failed before any row ran: the submit request had no field for the format."""
    from .group_util import read_output, spill, write_input
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)
    rows = write_input(tmp_path / "in.jsonl", 4, max_tokens=4)
    out = tmp_path / "out.jsonl"
    said = spill("run", make_tiny("llama"), tmp_path / "in.jsonl", "-o", out, "--kv-bits", "8", "--kv-group-size", "32")
    assert said.returncode == 0, said.stdout + said.stderr
    written = read_output(out)
    assert sorted(written) == sorted(r["custom_id"] for r in rows)
    assert all(row["error"] is None and row["response"]["body"]["usage"]["completion_tokens"] == 4 for row in written.values())
    job = json.loads(next((tmp_path / "home" / "jobs").glob("*/job.json")).read_text())
    assert (job["params"]["kv_bits"], job["params"]["kv_group_size"]) == (8, 32)


def test_a_job_whose_rows_all_fit_is_not_told_it_is_kv_bound_when_its_slowest_drafting_rows_run_on_alone(
        make_tiny, tmp_path, monkeypatch, llama_calibration):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    seed_home(tmp_path / "home", llama_calibration)
    (tmp_path / "home" / "calibration" / "group.json").unlink(missing_ok=True)
    monkeypatch.setattr(calibration, "read_probe", lambda files: 2e9)
    folder = make_tiny("llama")
    for stored in (tmp_path / "home" / "calibration").glob("*.json"):   # short rows apart: half accept no draft
        data = json.loads(stored.read_text())
        data["drafts"] = {"accepted": 70.0, "tried": 100.0, "count": 100, "tiers": {"short (<=128)": {
            "accepted": 70.0, "tried": 100.0, "count": 100, "rows": [0.0] * 8 + [1.0] * 8}}}
        stored.write_text(json.dumps(data))
    out = runner.invoke(app, ["estimate", str(folder), str(_tiers(tmp_path)), "--memory", "4GiB", "--stream",
                              "--speculate", "auto", "--json"])
    assert out.exit_code == 0, out.output
    est = json.loads(out.stdout)
    assert est["drafts"]["tiers"]["short (<=128)"] == 0.7   # its fast rows end early, its slowest run on alone
    assert est.get("kv_hint") is None   # every row fits the budget at once: no KV format runs more
