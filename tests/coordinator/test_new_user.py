"""What a new user meets following the README: refusals that make nothing, advice that leads somewhere,
first uses that say what they do, and help that matches what the commands take."""

import json
import re
import shutil
from collections import namedtuple

import pytest
import structlog
from rich.console import Console
from typer.testing import CliRunner

from spill import messages as m
from spill.coordinator import models, run
from spill.coordinator.cli import app
from spill.coordinator.daemon import Group
from spill.coordinator.jobstore import Job, list_jobs
from spill.coordinator.supervisor import ACTORS
from spill.errors import SpillError

from .test_daemon import Box, Sup

runner = CliRunner()
GIB = 1 << 30


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(models, "DEMO", {**models.DEMO, "size": "tiny"})   # a demo made in a second
    return tmp_path / "home"


@pytest.fixture
def no_group(monkeypatch):
    """A command that must be refused before it reaches or starts a group."""
    def connect(*_):
        raise AssertionError("a group was started or reached")
    monkeypatch.setattr(run, "_connect", connect)


class FakeClient:
    """Records the submit and stops the command there."""
    def __init__(self, asked):
        self.asked = asked

    def request(self, req, timeout_s=None):
        self.asked.append((req.op, vars(req)))
        raise SpillError("stopped by the test")

    def close(self):
        pass


def _group(args: dict | None = None) -> Group:
    sup = Sup()
    sup.args = args or {}
    g = Group(Box(), sup, structlog.get_logger())
    for role in ACTORS:
        g.on_actor(m.Ready(role, 1))
    return g


def _model(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')   # submit classifies the model first
    return folder


def _input(tmp_path, n: int = 3, name: str = "in.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"p {i}"}) + "\n" for i in range(n)))
    return path


def _submit(g: Group, **args):
    return g.handle(m.SubmitJob(**args))


def _one_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_resume_with_a_model_and_input_is_refused_in_one_sentence(home, tmp_path, no_group):
    result = runner.invoke(app, ["run", "demo", str(_input(tmp_path)), "--resume", "260101-000000-abcdef"])
    assert _one_line(result) == ("spill: --resume 260101-000000-abcdef continues that job with its own model and "
                                 "input; give either MODEL and INPUT.jsonl, or --resume JOB_ID, not both")


def test_a_resumed_job_keeps_its_memory_budget_fraction_and_stream(home, tmp_path, monkeypatch):
    """A job started with --memory 1GB, resumed with `spill run --resume ID`, ran resident at an 18.4 GiB budget."""
    g = _group({"memory": GIB, "budget_fraction": 0.5})
    reply = _submit(g, model=str(_model(tmp_path)), input=str(_input(tmp_path)), stream=True)
    job = reply.job
    g.handle(m.Interrupt(job))
    asked = []
    monkeypatch.setattr(run, "_connect", lambda listen, memory: (asked.append(("group", memory)), (FakeClient(asked), None))[1])
    runner.invoke(app, ["run", "--resume", job])
    (_, memory), (op, args) = asked
    assert memory == {"memory": GIB, "budget_fraction": 0.5}       # the group it starts plans for the job's memory
    assert op == "submit" and (args["memory"], args["budget_fraction"], args["stream"]) == (GIB, 0.5, True)
    other = _group({"memory": None, "budget_fraction": None})        # a running group planning for other memory
    refused = _submit(other, resume=job)
    assert isinstance(refused, m.Refused) and refused.error == (
        f"job {job} ran with --memory 1.0 GiB but the running group was started with --memory none; `spill down`, "
        f"then `spill run --resume {job}` runs it with its own settings")
    again = _group({"memory": GIB, "budget_fraction": 0.5})
    assert isinstance(_submit(again, resume=job), m.Queued)


def test_a_refusal_for_output_space_makes_no_job_and_no_file_and_says_readable_sizes(home, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(models.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 12 * 1024, 12 * 1024))
    out, inp = tmp_path / "out.jsonl", _input(tmp_path, 2000)
    reply = _submit(_group(), model=str(_model(tmp_path)), input=str(inp), output=str(out))
    assert isinstance(reply, m.Refused) and reply.error == (f"the job's output may need 5.1 MiB in {out} but 12.0 KiB is free there; "
                                            "free 5.0 MiB there, or write it elsewhere with -o")
    assert not out.exists() and list_jobs() == []


def test_the_output_space_is_checked_before_any_group_starts(home, make_tiny, tmp_path, monkeypatch, no_group):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(models.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 12 * 1024, 12 * 1024))
    out = tmp_path / "out.jsonl"
    line = _one_line(runner.invoke(app, ["run", str(make_tiny("llama")), str(_input(tmp_path, 2000)), "-o", str(out)]))
    assert line.startswith("spill: the job's output may need 5.1 MiB in ") and "12.0 KiB is free there" in line
    assert not out.exists()


def test_a_model_folder_without_tokenizer_files_is_refused_before_any_group_starts(home, make_tiny, tmp_path,
                                                                                   no_group):
    folder = tmp_path / "m"
    shutil.copytree(make_tiny("llama"), folder)
    (folder / "tokenizer.json").unlink()
    line = _one_line(runner.invoke(app, ["run", str(folder), str(_input(tmp_path))]))
    assert line == (f"spill: model folder {folder} has no tokenizer: expected tokenizer.json (or tokenizer.model) "
                    "beside config.json; copy the tokenizer files from the model's repository")


def test_after_the_input_changed_the_advice_names_another_output_path(home, tmp_path, no_group):
    inp, out = _input(tmp_path), tmp_path / "out.jsonl"
    job = Job.create(inp, "demo", {"max_tokens": 8}, out)
    job.set_status("interrupted")
    _input(tmp_path, 4)   # the input changes
    first = _one_line(runner.invoke(app, ["run", "demo", str(inp), "-o", str(out)]))
    assert "start a new job with `spill run --new` and another -o path (that file stays the old job's)" in first
    again = _one_line(runner.invoke(app, ["run", "demo", str(inp), "-o", str(out), "--new"]))
    assert again == (f"spill: {out} is the output of job {job.id}, whose input changed or is gone since; "
                     "choose another -o path, or move that file away")
    resumed = _one_line(runner.invoke(app, ["run", "--resume", job.id]))
    assert "and another -o path" in resumed


def test_spill_check_takes_demo_as_spill_run_does(home, monkeypatch):
    from spill.streamer import check
    monkeypatch.setattr(check, "run_check", lambda folder, **kw: (_ for _ in ()).throw(SpillError(f"checked {folder}")))
    result = runner.invoke(app, ["check", "demo"])
    assert result.output == f"spill: checked {home / 'models' / 'demo'}\n"


def test_help_says_what_model_takes_every_size_and_every_image_format():
    from spill.factory.presets import SIZES

    def help_of(*cmd) -> str:
        return " ".join(runner.invoke(app, [*cmd, "--help"], terminal_width=400).output.split())
    for cmd in ("run", "estimate", "check"):
        assert "a tag (`spill models` lists them), a Hugging Face id org/name[@revision], or 'demo'" in help_of(cmd)
    sizes = re.search(r"Size preset: ([\w ,]+)\.", help_of("make-model")).group(1).replace(" or ", ", ")
    assert sizes.split(", ") == list(SIZES)
    assert "Image to write: .png, .svg or .pdf" in help_of("report")


def test_a_second_spill_up_and_a_racer_that_lost_exit_alike(home, monkeypatch):
    from spill.coordinator import client, rundir
    monkeypatch.setattr(rundir, "held_by_sentence", lambda: "another spill group is running (coordinator pid 7)")
    monkeypatch.setattr(client, "start_group", lambda *a, **kw: None)       # lost the race to another `spill up`
    racer = runner.invoke(app, ["up"])
    monkeypatch.setattr(rundir, "record", lambda: {"pid": 7, "control": "ipc://x"})   # one already up
    later = runner.invoke(app, ["up"])
    assert (racer.exit_code, racer.output) == (later.exit_code, later.output) == (
        0, "another spill group is running (coordinator pid 7)\n")


def test_piped_spill_models_prints_whole_repo_ids(home, monkeypatch):
    repo = "some-organisation-with-a-long-name/Some-Model-With-A-Long-Name-Instruct-4bit"
    monkeypatch.setattr(models, "tags", lambda: models.read_tags(
        f"long:tag: {{repo: {repo}, revision: main, quantization: 4bit, note: a note that is long enough to squeeze}}"))
    assert repo in runner.invoke(app, ["models"]).output


def test_the_live_view_keeps_the_tokens_column_at_80_columns():
    from spill.coordinator.live import _view
    s = m.JobStatus("j", "running", done=1, total=9, slots=[m.Slot("request-000123-abcdef", 417, "text so far " * 20)])
    console = Console(width=80, record=True)
    console.print(_view(s, quiet=False))
    header, _, row = console.export_text().splitlines()[:3]
    assert "tokens" in header and "417" in row.split()


def test_a_first_spill_estimate_says_it_makes_the_demo_and_calibrates(home, tmp_path, monkeypatch):
    from spill.admission import calibration
    monkeypatch.setattr(calibration, "read_probe", lambda files: 2e9)
    result = runner.invoke(app, ["estimate", "demo", str(_input(tmp_path))])
    assert result.exit_code == 0, result.output
    said = result.stderr.splitlines()
    assert said[0] == "first use: making the demo model (a few seconds)"
    assert re.fullmatch(rf"made the demo model in {home / 'models' / 'demo'} in \d+ s", said[1])
    assert re.fullmatch(r"calibrating this model on this machine: ~\d+ s", said[2])
    assert re.fullmatch(r"calibrated demo on this machine in \d+ s", said[3])
    assert result.stdout.startswith("estimate: ")
    assert runner.invoke(app, ["estimate", "demo", str(_input(tmp_path))]).stderr == ""   # the second use: nothing


class EstimatingClient(FakeClient):
    """Takes the submit; the job is `estimating` at the first status, and the command stops at the second."""
    def request(self, req, timeout_s=None):
        self.asked.append((req.op, vars(req)))
        if req.op == "submit":
            return m.Queued("j1", 3, 0, 0, "out.jsonl", 0)
        if [a for a, _ in self.asked].count("status") == 1:
            return m.JobStatus("j1", "estimating")
        raise SpillError("stopped by the test")


def test_a_first_spill_run_says_it_makes_the_demo_and_that_the_group_calibrates(home, tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(run, "_connect", lambda listen, memory: (EstimatingClient(asked), None))
    result = runner.invoke(app, ["run", "demo", str(_input(tmp_path))])
    said = result.stderr.splitlines()
    assert said[0] == "first use: making the demo model (a few seconds)"
    assert said[2] == "calibrating this model on this machine (first use)"
    assert [op for op, _ in asked] == ["submit", "status", "status"]   # said while the job was estimating


def test_a_metrics_port_already_taken_is_said_on_the_screen_and_in_status(home, tmp_path, llama_calibration):
    import socket
    from .group_util import seed_home, spill
    seed_home(home, llama_calibration)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        up = spill("up", env={"SPILL_METRICS_PORT": str(port)})
        try:
            assert up.returncode == 0, up.stdout + up.stderr
            fix = (f"metrics: not served: 127.0.0.1:{port} is in use (another spill group or program); start the "
                   "group with `spill up --metrics-port PORT`, or set SPILL_METRICS_PORT for a `spill run` that "
                   "starts its own")
            assert up.stderr == f"warning: {fix}\n"
            assert spill("status", check=True).stdout.splitlines()[3] == fix
        finally:
            spill("down")
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    up = spill("up", "--metrics-port", str(port), check=True)
    try:
        assert up.stdout.splitlines()[-1] == f"metrics: http://127.0.0.1:{port}/metrics"
        assert spill("status", check=True).stdout.splitlines()[3] == f"metrics: http://127.0.0.1:{port}/metrics"
    finally:
        spill("down")
