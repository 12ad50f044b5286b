"""`spill run`'s live view: a tail of 8 running rows and a progress line, redrawn as passes end.
With --quiet only the progress line; when stdout is not a terminal, plain log lines."""

import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

FINAL = ("done", "interrupted", "failed")


def progress_line(s: dict) -> str:
    def fmt(v, f):
        return f.format(v) if v is not None else "-"
    eta = s.get("eta_s")
    # a running row gains one token per pass, so its per-token latency is the pass time
    eta_txt = f"{int(eta // 3600)}h{int(eta % 3600 // 60):02d}m{int(eta % 60):02d}s" if eta is not None else "-"
    return (f"rows {s.get('done', 0)}/{s.get('total', '?')}  {fmt(s.get('tokens_per_s'), '{:.1f}')} tok/s  "
            f"latency {fmt(s.get('pass_s'), '{:.2f}')} s/token  pass {fmt(s.get('pass_s'), '{:.2f}')} s  "
            f"peak {s.get('peak_memory', 0) / 2**30:.2f} GiB  ETA {eta_txt}")


def _view(s: dict, quiet: bool):
    line = Text(progress_line(s))
    if quiet:
        return line
    table = Table(expand=True, show_edge=False)
    table.add_column("custom_id", no_wrap=True, max_width=24)
    table.add_column("tokens", no_wrap=True, justify="right")
    table.add_column("text so far", no_wrap=True, overflow="ellipsis")
    for cid, n, tail in s.get("slots", [])[-8:]:
        table.add_row(str(cid)[:24], str(n), tail.replace("\n", " ")[-80:])
    return Group(table, line)


def follow(status, quiet: bool = False, poll_s: float = 0.25) -> dict:
    """Show the job until it ends (`status()` gives its figures); returns its last status."""
    if not sys.stdout.isatty():
        return _follow_plain(status, poll_s)
    with Live(_view({}, quiet), console=Console(), refresh_per_second=8, transient=False) as live:
        while True:
            s = status()
            live.update(_view(s, quiet))
            if s.get("status") in FINAL:
                return s
            time.sleep(poll_s)


def _follow_plain(status, poll_s: float) -> dict:
    last, last_t = None, 0.0
    while True:
        s = status()
        now = time.monotonic()
        if s.get("status") in FINAL or (s.get("done") != last and now - last_t > 2.0):
            slots = s.get("slots") or []
            latest = f"  | {slots[-1][0]}: {slots[-1][2][-60:]!r}" if slots else ""
            print(progress_line(s) + latest, flush=True)
            last, last_t = s.get("done"), now
        if s.get("status") in FINAL:
            return s
        time.sleep(poll_s)
