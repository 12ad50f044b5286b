"""The advisor through the front door: a job whose model fits runs resident (one line says so), reads
the weights only in its first pass, and writes what `--stream` and mlx-lm resident write."""

from spill.coordinator.history import read as read_passes
from spill.coordinator.jobstore import Job
from spill.streamer.plan import load_plan

from .group_util import one_group, read_output, resident_texts, spill, texts, write_input

RESIDENT = {"SPILL_STREAM": "0"}   # the suite streams by default (tests/conftest.py)


def test_a_job_that_fits_runs_resident_and_writes_what_streaming_writes(make_tiny, tmp_path):
    folder = make_tiny("llama")
    rows = write_input(tmp_path / "in.jsonl", 10, max_tokens=6)
    with one_group(RESIDENT):   # both jobs on one group: the resident one first, its first pass the group's first
        resident = spill("run", folder, tmp_path / "in.jsonl", "-o", tmp_path / "r.jsonl", env=RESIDENT, check=True)
        streamed = spill("run", folder, tmp_path / "in.jsonl", "-o", tmp_path / "s.jsonl", "--stream", env=RESIDENT,
                         check=True)
    lines = resident.stdout.splitlines()
    assert lines[1].startswith("resident: the weights (") and " for 10 rows at once) fit the " in lines[1]
    assert lines[1].endswith("; only the first pass reads the disk (--stream streams every pass)")
    assert " resident passes (ideal " in lines[2]
    job = Job.open(lines[0].split()[1].rstrip(":"))
    assert job.meta["estimate"]["mode"] == "resident" and job.meta["estimate"]["advice"] == lines[1]
    read = [p["bytes_streamed"] for p in read_passes(job.dir)]
    assert len(read) > 2 and read == [load_plan(folder).streamed_bytes] + [0] * (len(read) - 1)
    assert streamed.stdout.splitlines()[1].startswith("streamed (--stream or SPILL_STREAM), though resident would fit: ")
    assert all(p["bytes_streamed"] > 0 for p in read_passes(Job.open(streamed.stdout.split()[1].rstrip(":")).dir))
    got = texts(read_output(tmp_path / "r.jsonl"))
    assert got == texts(read_output(tmp_path / "s.jsonl")) == resident_texts(folder, rows)
