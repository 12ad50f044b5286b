"""Pass history and `spill report JOB`."""

from typer.testing import CliRunner

from spill import messages as m
from spill.admission import calibration
from spill.coordinator import history, plot
from spill.coordinator.batch_input import read_batch
from spill.coordinator.cli import app
from spill.coordinator.jobrun import JobRun
from spill.coordinator.jobstore import Job

runner = CliRunner()


def _job(tmp_path, model):
    tmp_path.mkdir(exist_ok=True)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(f'{{"custom_id": "r{i}", "prompt": "x"}}\n' for i in range(3)))
    requests, _ = read_batch(inp)
    job = Job.create(inp, model, {"max_tokens": 5}, tmp_path / "out.jsonl")
    return JobRun(job, requests, model, {"max_tokens": 5})


def _pass(i, rows=2, finished=()):
    return m.Pass(1, i, 2.0 + i / 10, 0.1, 1.5, rows, 16 if i == 0 else 0, rows, list(finished),
                  100_000_000 * (i + 1), 300_000_000, 4_000_000)


def test_each_pass_becomes_one_line_in_the_job_folder(tmp_path):
    run = _job(tmp_path, "demo")
    run.on_pass(_pass(0))
    run.on_done(m.Done(1, [0], ["hi"], ["length"], [1], [5]))
    run.on_pass(_pass(1, finished=[0]))
    (run.job.dir / history.FILE).open("a").write('{"torn')
    lines = history.read(run.job.dir)
    assert [(p["index"], p["done"], p["finished"], p["decode_rows"]) for p in lines] == [(0, 0, 0, 2), (1, 1, 1, 2)]
    assert lines[1]["time"] >= lines[0]["time"] and lines[0]["bytes_streamed"] == 4_000_000


def test_each_pass_line_keeps_the_rows_it_finished_and_the_live_eta(tmp_path):
    """The job benchmark reads the ETA at 25/50/75% and each tier's finishing times from these lines."""
    run = _job(tmp_path, "demo")

    class Estimate:
        def started(self, at):
            pass

        def eta(self, pending, generated):
            return 10.0 * len(pending)
    run.estimate = Estimate()
    run.on_pass(_pass(0))
    run.on_done(m.Done(1, [0, 2], ["a", "b"], ["length"] * 2, [1] * 2, [5] * 2))
    run.on_pass(_pass(1, finished=[0, 2]))
    lines = history.read(run.job.dir)
    assert [(p["finished_rows"], p["eta_s"]) for p in lines] == [([], 30.0), ([0, 2], 10.0)]
    plain = _job(tmp_path / "plain", "demo")   # no estimate: no ETA
    plain.on_pass(_pass(0))
    assert history.read(plain.job.dir)[0]["eta_s"] is None


def test_report_writes_a_png_with_the_roofline_from_this_machines_calibration(tmp_path, make_tiny, monkeypatch):
    folder = make_tiny("llama")
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))     # a first use of this model here
    monkeypatch.setattr(calibration, "read_probe", lambda files: 1.25e9)
    calibration.open_calibration(folder)
    run = _job(tmp_path, str(folder))
    run.job.set_status("running", estimate={"total_seconds": 30.0, "timeline": [[0, 0], [30, 3]]})
    for i in range(5):
        run.on_pass(_pass(i))
    drawn = []
    real = plot.write_report
    monkeypatch.setattr(plot, "write_report", lambda job, out, bw: drawn.append(bw) or real(job, out, bw))
    result = runner.invoke(app, ["report", run.job.id])
    assert result.exit_code == 0, result.output
    png = run.job.dir / "report.png"
    assert result.output.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == [1.25e9]


def test_report_of_a_job_without_passes_is_one_sentence(tmp_path):
    run = _job(tmp_path, "demo")
    result = runner.invoke(app, ["report", run.job.id])
    assert result.exit_code == 2
    assert result.output.strip() == f"spill: job {run.job.id} has no passes recorded yet; run it (`spill run`) and report again"
    result = runner.invoke(app, ["report", "nope"])
    assert result.exit_code == 2 and "`spill status` lists the jobs" in result.output


def test_a_report_path_it_cannot_write_is_one_sentence_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    run = _job(tmp_path, "demo")
    for i in range(3):
        run.on_pass(_pass(i))
    cases = {str(tmp_path / "nope" / "r.png"): f"spill: folder {tmp_path / 'nope'} does not exist; create it or choose another -o path",
             str(tmp_path / "r.txt"): "spill: -o " + str(tmp_path / "r.txt") + " is not an image name; end it in .png, .svg or .pdf",
             str(tmp_path): f"spill: -o {tmp_path} is a folder; give a file path such as {tmp_path / 'report.png'}"}
    for out, said in cases.items():
        result = runner.invoke(app, ["report", run.job.id, "-o", out])
        assert result.exit_code == 2 and result.output.strip() == said, result.output
    assert not (tmp_path / "r.txt").exists()
    result = runner.invoke(app, ["report", run.job.id, "-o", str(tmp_path / "r.svg")])
    assert result.exit_code == 0 and (tmp_path / "r.svg").read_text().lstrip().startswith("<?xml")
    assert [p.name for p in tmp_path.iterdir() if "r.svg" in p.name] == ["r.svg"]   # no temporary left


def test_a_report_the_disk_refuses_is_one_sentence(tmp_path, monkeypatch):
    from matplotlib.figure import Figure
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    run = _job(tmp_path, "demo")
    run.on_pass(_pass(0))

    def refuse(self, path, **kw):
        open(path, "wb").write(b"half")   # what a full disk leaves behind
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Figure, "savefig", refuse)
    result = runner.invoke(app, ["report", run.job.id, "-o", str(tmp_path / "r.png")])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"spill: could not write {tmp_path / 'r.png'} (Permission denied); choose another -o path"
    assert not any("r.png" in p.name for p in tmp_path.iterdir())
