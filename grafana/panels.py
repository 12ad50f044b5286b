"""A picture of the dashboard's main panels where no Grafana runs: one job's metrics, scraped from the group's
endpoint every --every seconds while `spill run` runs it, drawn with matplotlib (each panel's query computed
from the scrapes as Prometheus would over the same samples).

    python grafana/panels.py demo examples/sample.jsonl --stream --memory 600MB -o docs/dashboard-panels.png
"""

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict | None:
    """{(name, labels as a sorted tuple): value} of one scrape, None where the endpoint does not answer."""
    try:
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def record(args) -> list[tuple[float, dict]]:
    """Run the job with a metrics endpoint of its own and scrape it until `spill run` exits."""
    port = free_port()
    env = {**os.environ, "SPILL_METRICS_PORT": str(port)}
    cmd = [sys.executable, "-m", "spill.coordinator.cli", "run", args.model, args.input, "--quiet", "--new",
           *(["--stream"] if args.stream else []), *(["--memory", args.memory] if args.memory else [])]
    job = subprocess.Popen(cmd, env=env)
    start, scrapes = time.monotonic(), []
    while True:
        got = scrape(f"http://127.0.0.1:{port}/metrics")
        if got:
            scrapes.append((time.monotonic() - start, got))
        if job.poll() is not None and (got is None or not scrapes):
            break
        time.sleep(args.every)
    return scrapes


def value(s: dict, name: str, **labels) -> float:
    """The sum of a metric's samples whose labels include `labels` (0 where none)."""
    return sum(v for (n, ls), v in s.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def rate(scrapes, name: str, window: int = 4, **labels):
    """(times, per-second increase over the last `window` scrapes) of a counter."""
    ts, out = [], []
    for i in range(window, len(scrapes)):
        (t0, a), (t1, b) = scrapes[i - window], scrapes[i]
        ts.append(t1)
        out.append((value(b, name, **labels) - value(a, name, **labels)) / (t1 - t0))
    return ts, out


def draw(scrapes, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = [x for x, _ in scrapes]
    fig, ax = plt.subplots(2, 3, figsize=(13, 6.5))
    done = [100 * value(s, "spill_job_rows", state="done") / max(value(s, "spill_job_rows"), 1) for _, s in scrapes]
    ax[0, 0].plot(t, done)
    ax[0, 0].set(title="Job: progress", ylabel="% of rows done")
    for state in ("waiting", "running", "done"):
        ax[0, 1].plot(t, [value(s, "spill_job_rows", state=state) for _, s in scrapes], label=state)
    ax[0, 1].set(title="Job: rows by state", ylabel="rows")
    ax[0, 1].legend()
    ax[0, 2].plot(*rate(scrapes, "spill_generated_tokens_total"), label="generated")
    ax[0, 2].plot(*rate(scrapes, "spill_prompt_tokens_total"), label="prompt")
    ax[0, 2].set(title="Job: tokens per second", ylabel="tokens/s")
    ax[0, 2].legend()
    ts, secs = rate(scrapes, "spill_pass_duration_seconds_sum")
    _, count = rate(scrapes, "spill_pass_duration_seconds_count")
    ax[1, 0].plot(ts, [s / c if c else float("nan") for s, c in zip(secs, count)])
    ax[1, 0].set(title="Passes: mean pass duration", ylabel="seconds")
    for phase in ("read_wait", "compute", "overhead"):
        _, p = rate(scrapes, "spill_pass_phase_seconds_total", phase=phase)
        ax[1, 1].plot(ts, [x / s if s else float("nan") for x, s in zip(p, secs)], label=phase)
    ax[1, 1].set(title="Passes: time by phase", ylabel="share of pass time")
    ax[1, 1].legend()
    gib = 2 ** 30
    ax[1, 2].plot(t, [value(s, "spill_memory_live_bytes") / gib for _, s in scrapes], label="live")
    for name in ("budget", "guard", "hard"):
        ax[1, 2].plot(t, [value(s, f"spill_memory_{name}_bytes") / gib for _, s in scrapes], "--", label=name)
    ax[1, 2].set(title="Memory: live against the budget", ylabel="GiB")
    ax[1, 2].legend()
    for a in ax.flat:
        a.set_xlabel("seconds since the group started")
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("input")
    p.add_argument("-o", "--out", type=Path, default=Path("dashboard-panels.png"))
    p.add_argument("--stream", action="store_true")
    p.add_argument("--memory", help="spill run's --memory (a smaller working set puts live memory near its lines)")
    p.add_argument("--every", type=float, default=0.5, help="seconds between scrapes")
    args = p.parse_args()
    scrapes = record(args)
    if len(scrapes) < 6:
        sys.exit(f"only {len(scrapes)} scrapes: the job was too short to draw")
    draw(scrapes, args.out)
    print(args.out)


if __name__ == "__main__":
    main()
