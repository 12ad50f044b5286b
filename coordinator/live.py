"""`spill run`'s live view: a tail of 8 running rows and a progress line, redrawn as passes end.
With --quiet only the progress line; when stdout is not a terminal, a plain progress line every
`every` seconds (none with --quiet), and the last one when the job ends."""

import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from spill.messages import JobStatus

FINAL = ("done", "interrupted", "cancelled", "failed")


def waiting_line(s) -> str:
    """A queued job (an m.JobStatus): what it waits behind."""
    if not s.ahead:
        return "queued: starting"
    first = s.ahead[0]
    more = f", then {len(s.ahead) - 1} more queued job(s)" if len(s.ahead) > 1 else ""
    return f"queued behind job {first.job} ({first.done}/{first.total} rows){more}"


def progress_line(s) -> str:
    """A job's one line, from its m.JobStatus."""
    if s.status == "estimating":
        return "estimating: " + (s.estimating or "counting the rows' tokens")
    if s.status == "queued":
        return waiting_line(s)
    def fmt(v, f):
        return f.format(v) if v is not None else "-"
    eta = s.eta_s
    # a running row gains one token per pass, so its per-token latency is the pass time
    eta_txt = f"{int(eta // 3600)}h{int(eta % 3600 // 60):02d}m{int(eta % 60):02d}s" if eta is not None else "-"
    return (f"rows {s.done or 0}/{'?' if s.total is None else s.total}  {fmt(s.tokens_per_s, '{:.1f}')} tok/s  "
            f"latency {fmt(s.pass_s, '{:.2f}')} s/token  pass {fmt(s.pass_s, '{:.2f}')} s  "
            f"peak {s.peak_memory / 2**30:.2f} GiB  ETA {eta_txt}")


def _view(s, quiet: bool):
    line = Text(progress_line(s))
    if quiet:
        return line
    table = Table(expand=True, show_edge=False)
    # the text gives way first: at 80 columns rich would squeeze the tokens column out
    table.add_column("custom_id", no_wrap=True, min_width=12, max_width=24)
    table.add_column("tokens", no_wrap=True, justify="right", min_width=6)
    table.add_column("text so far", no_wrap=True, overflow="ellipsis", ratio=1)
    for slot in s.slots[-8:]:
        table.add_row(str(slot.custom_id)[:24], str(slot.tokens), slot.tail.replace("\n", " ")[-80:])
    return Group(table, line)


def follow(status, quiet: bool = False, poll_s: float = 0.25, every: float = 10.0):
    """Show the job until it ends (`status()` gives its m.JobStatus); returns its last status."""
    if not sys.stdout.isatty():
        return follow_plain(status, quiet=quiet, every=every, poll_s=poll_s)
    said: list[str] = []
    with Live(_view(JobStatus(), quiet), console=Console(), refresh_per_second=8, transient=False) as live:
        while True:
            s = status()
            tell(s, said, live.console.print)
            live.update(_view(s, quiet))
            if s.status in FINAL:
                return s
            time.sleep(poll_s)


def tell(s, said: list[str], say) -> None:
    """Each of the job's notes (a pipeline's lost rank) not said yet, a line each, --quiet or not."""
    for note in s.notes[len(said):]:
        say(f"note: {note}")
        said.append(note)


def follow_plain(status, *, quiet: bool, every: float, poll_s: float = 0.25,
                 clock=time.monotonic, sleep=time.sleep):
    """Piped: a progress line every `every` seconds whether or not a row finished; --quiet: none."""
    next_at, said = clock(), []
    while True:
        s = status()
        tell(s, said, lambda line: print(line, flush=True))
        if s.status in FINAL:
            return s
        if not quiet and clock() >= next_at:
            latest = f"  | {s.slots[-1].custom_id}: {s.slots[-1].tail[-60:]!r}" if s.slots else ""
            print(progress_line(s) + latest, flush=True)
            next_at = clock() + every
        sleep(poll_s)
