"""The live view when stdout is a pipe: a progress line at a steady interval, none with --quiet."""

from spill import messages as m
from spill.coordinator.live import follow_plain, progress_line


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def _job(clock, ends_at: float):
    """A job whose finished-row count never changes for `ends_at` seconds (a long prompt tier)."""
    def status():
        running = clock() < ends_at
        return m.JobStatus("j", "running" if running else "done", done=3, total=9)
    return status


def test_piped_output_prints_a_line_every_interval_even_when_no_row_finished(capsys):
    clock = FakeClock()
    final = follow_plain(_job(clock, 35.0), quiet=False, every=10.0, clock=clock, sleep=clock.sleep)
    assert final.status == "done"
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(line.startswith("rows 3/9") for line in lines)   # at 0, 10, 20, 30 s


def test_piped_quiet_prints_no_progress_lines(capsys):
    clock = FakeClock()
    follow_plain(_job(clock, 35.0), quiet=True, every=10.0, clock=clock, sleep=clock.sleep)
    assert capsys.readouterr().out == ""


def test_a_queued_job_says_what_it_waits_behind():
    s = m.JobStatus("b", "queued", ahead=[m.Ahead("a", 5, 20), m.Ahead("c", 0, 4)])
    assert progress_line(s) == "queued behind job a (5/20 rows), then 1 more queued job(s)"
