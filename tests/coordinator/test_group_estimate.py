"""The estimate through the front door: `spill run` prints it before its first pass, job.json keeps it
and the end-of-job summary, and `spill report` plots the job."""

import json

from spill.coordinator.jobstore import Job

from .group_util import read_output, spill, write_input


def test_run_prints_the_estimate_first_and_the_summary_last(make_tiny, tmp_path):
    folder = make_tiny("llama")
    write_input(tmp_path / "in.jsonl", 12, max_tokens=6)
    result = spill("run", folder, tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", check=True)
    lines = result.stdout.splitlines()
    assert lines[0].startswith("job ") and lines[2].startswith("estimate: ") and " passes (ideal " in lines[2]
    assert lines[1].startswith("streamed (--stream or SPILL_STREAM), though resident would fit: ")   # the tests' default
    job = Job.open(lines[0].split()[1].rstrip(":"))
    est, summary = job.meta["estimate"], job.meta["summary"]
    assert est["line"] == lines[2] and est["advice"] == lines[1] and est["mode"] == "streamed" and est["total_seconds"] > 0 and est["timeline"][-1][1] == 12
    assert summary["finish_reasons"] == {"length": 12} or sum(summary["finish_reasons"].values()) == 12
    assert summary["output_tokens"]["max"] <= 6 and summary["passes"] > 0 and summary["actual_seconds"] > 0
    last = lines[-2:] if summary["drafts"] else lines[-1:]   # auto drafted: its drafts line closes the summary
    assert last[0].startswith(f"{summary['passes']} passes, ") and all(l.startswith("drafts: ") for l in last[1:])
    assert any(l.startswith("took ") and "against an estimate of" in l for l in lines)
    records = (job.dir / "passes.jsonl").read_text().splitlines()   # a pass each, then the last rows written
    assert len(records) == summary["passes"] + 1 and '"written": true' in records[-1]
    bodies = [row["response"]["body"] for row in read_output(tmp_path / "out.jsonl").values()]
    tokens = sum(b["usage"]["completion_tokens"] + (b["choices"][0]["finish_reason"] == "stop") for b in bodies)
    assert sum(json.loads(r).get("emitted", 0) for r in records) == tokens   # the last pass recorded too (EOS counts)
    report = spill("report", job.id, "-o", tmp_path / "r.png", check=True)
    assert report.stdout.strip() == str(tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
