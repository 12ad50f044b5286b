"""--memory and --budget-fraction through the front door: checked, passed to every actor, shown by status."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spill import config
from spill.coordinator.cli import app

from .group_util import read_output, spill, write_input

runner = CliRunner()


@pytest.mark.parametrize("command", ["run", "up"])
@pytest.mark.parametrize("flag,value,says", [
    ("--memory", "lots", "spill: --memory 'lots' is not a size; write it like 48GB, 1.5GiB or 900M"),
    ("--budget-fraction", "1.2", "spill: --budget-fraction must be above 0 and at most 1 (the default is 0.78, 0.9 on a CUDA GPU); got 1.2")])
def test_bad_flags_get_one_line(tmp_path, command, flag, value, says):
    args = ["run", "demo", str(tmp_path / "in.jsonl")] if command == "run" else ["up"]
    result = runner.invoke(app, [*args, flag, value])
    assert result.exit_code == 2 and result.output.strip() == says, result.output


def _actor_args(pid: int) -> dict:
    return json.loads(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[3])


def test_up_passes_memory_to_every_actor_and_status_shows_it(make_tiny, tmp_path):
    folder = make_tiny("llama")
    write_input(tmp_path / "in.jsonl", 3, max_tokens=2)
    try:
        spill("up", "--memory", "3GiB", "--budget-fraction", "0.5", check=True)
        status = spill("status", check=True).stdout.splitlines()
        assert status[2] == "memory: working set 3.0 GiB (--memory), budget 50% = 1.5 GiB"
        log = (config.home() / "run" / "logs" / "coordinator.log").read_text().splitlines()
        event = [json.loads(line) for line in log if '"event": "memory"' in line][-1]
        assert (event["working_set"], event["source"], event["budget"]) == (3 * 2**30, "--memory", 3 * 2**29)
        pids = {part.split()[0]: int(part.split()[-1]) for part in status[0][len("group: "):].split("  ")}
        assert set(pids) == {"coordinator", "tokenizer", "admission", "streamer"}
        for role, pid in pids.items():
            args = _actor_args(pid)
            args = args["actor_args"] if role == "coordinator" else args
            assert (args["memory"], args["budget_fraction"]) == (3 * 2**30, 0.5)
        refused = spill("run", folder, tmp_path / "in.jsonl", "--memory", "2GiB")
        assert refused.returncode == 2 and refused.stderr.strip() == (
            "spill: the running group was started with --memory 3.0 GiB; run without --memory, "
            "or `spill down` and run again to start a group with the new value")
        spill("run", folder, tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--quiet", check=True)
    finally:
        spill("down")
    assert len(read_output(tmp_path / "out.jsonl")) == 3


# a group without flags names its detected source: test_group.py::test_up_run_status_down


def test_an_embedded_run_plans_for_its_memory_flag(make_tiny, tmp_path):
    folder = make_tiny("llama")
    write_input(tmp_path / "in.jsonl", 3, max_tokens=2)
    spill("run", folder, tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--quiet",
          "--memory", "2GiB", "--budget-fraction", "0.6", check=True)
    assert len(read_output(tmp_path / "out.jsonl")) == 3
    logs = config.home() / "run" / "logs"
    budget = [json.loads(line) for line in (logs / "admission.log").read_text().splitlines()
              if '"event": "budget"' in line][-1]
    assert (budget["working_set"], budget["source"], budget["budget"]) == (2 * 2**30, "--memory", int(0.6 * 2**31))


def test_a_budget_no_row_fits_in_is_refused_before_a_job_or_its_output_is_made(make_tiny, tmp_path):
    folder, home = make_tiny("llama"), config.home()
    write_input(tmp_path / "in.jsonl", 3, max_tokens=2)
    out, jobs = tmp_path / "out.jsonl", set((home / "jobs").glob("*/job.json"))
    refused = spill("run", folder, tmp_path / "in.jsonl", "-o", out, "--quiet", "--memory", "10MB")
    said = refused.stderr.strip()
    assert refused.returncode == 2 and said.startswith("spill: the budget is 7.4 MiB (78% of the 9.5 MiB working "
                                                       "set, from --memory) but "), refused.stdout + said
    assert said.endswith("raise --memory or --budget-fraction, or use a machine with more memory"), said
    assert not out.exists() and set((home / "jobs").glob("*/job.json")) == jobs, "a refused command made a job"
    spill("run", folder, tmp_path / "in.jsonl", "-o", out, "--quiet", "--memory", "2GiB", check=True)
    assert len(read_output(out)) == 3
    spill("up", "--memory", "10MB", check=True)   # a long-lived group keeps its flags: the fix is a new group
    try:
        refused = spill("run", folder, tmp_path / "in.jsonl", "-o", tmp_path / "out2.jsonl", "--quiet")
        assert refused.returncode == 2 and refused.stderr.strip().endswith(
            "or use a machine with more memory; this group keeps the memory it was started with: "
            "`spill down`, then `spill up` with more"), refused.stderr
        assert not (tmp_path / "out2.jsonl").exists()
        assert spill("status", check=True).stdout.startswith("group: coordinator pid")   # the group stays up
    finally:
        spill("down")
