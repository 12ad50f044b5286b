"""What metrics and logging add to pass time.

    python benchmarks/observe_overhead.py [--model FOLDER] [--rows 32] [--max-tokens 24] [--repeats 3]

1. The same job through `spill`'s embedded group, alternately with the metrics endpoint off
   (SPILL_METRICS_PORT=0) and on, scraped every second (15 times Prometheus's default rate);
   time per pass is the wall time between the first and the last pass over the passes between.
2. The work itself, timed in one process: the coordinator's per pass (metrics fed and its `pass`
   log line written), the streamer's per pass (binding the pass index for its log lines), and one
   scrape of the endpoint, each against the pass time measured in 1.
"""

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from spill.platform import preload_env


def timed_job(folder: Path, rows: int, max_tokens: int, port: int) -> tuple[float, int]:
    """group_overhead.py's job through the embedded group, the endpoint on `port` scraped every second."""
    from group_overhead import through_group   # this folder's benchmark of the actor hops
    os.environ["SPILL_METRICS_PORT"] = str(port)
    stop = threading.Event()

    def scrape():
        while not stop.wait(1.0):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            except OSError:
                pass

    if port:
        threading.Thread(target=scrape, daemon=True).start()
    try:
        return through_group(folder, [f"Question {i}: say something about the number {i * 7}." for i in range(rows)],
                             max_tokens)
    finally:
        stop.set()


def work_per_pass(n: int = 2000) -> dict:
    """Seconds of the coordinator's and the streamer's observability work per pass, and per scrape."""
    from prometheus_client import generate_latest

    from spill import messages as m
    from spill import metrics as mt
    from spill.actor import bind_context, setup_logging
    from spill.coordinator.telemetry import Telemetry
    os.environ["SPILL_METRICS_PORT"] = "0"   # the registry is timed directly, not over HTTP
    log = setup_logging("coordinator")
    run = SimpleNamespace(pending=set(range(64)), job=SimpleNamespace(id="bench", counts=lambda: {"succeeded": 0, "failed": 0}),
                          model_name="bench", left_at_start=64, started=time.monotonic(), finished=False)
    group = SimpleNamespace(box=SimpleNamespace(send=lambda *a: None), sup=SimpleNamespace(pids=lambda: {}, restarts={}),
                            epoch=1, current=run)
    tele = Telemetry(group, log)
    msg = m.Pass(1, 0, 0.05, 0.01, 0.04, 32, 16, 32, [], 10**8, 2 * 10**8, 6 * 10**7)
    t0 = time.perf_counter()
    for i in range(n):
        msg.index = i
        tele.on_actor(msg)
        tele.update()
    coordinator = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for i in range(n):
        msg.index = i
        bind_context(msg)
    streamer = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(50):
        generate_latest(mt.REGISTRY)
    return {"coordinator": coordinator, "streamer": streamer, "scrape": (time.perf_counter() - t0) / 50}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if os.environ.get("LD_PRELOAD") != preload_env().get("LD_PRELOAD"):
        os.execve(sys.executable, [sys.executable, *sys.argv], preload_env())
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="/tmp/spill-bench/llama-small-bfloat16-seed0")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    os.environ.setdefault("SPILL_HOME", tempfile.mkdtemp(prefix="spill-observe-"))
    if not Path(a.model).exists():
        from spill.factory import make_model
        make_model(a.model, family="llama", size="small", seed=0, dtype="bfloat16")
    runs = {"off": [], "on": []}
    for _ in range(a.repeats):
        for mode in ("off", "on"):
            runs[mode].append(timed_job(Path(a.model), a.rows, a.max_tokens, free_port() if mode == "on" else 0))
    off = statistics.median(r[0] for r in runs["off"])
    on = statistics.median(r[0] for r in runs["on"])
    work = work_per_pass()
    print(f"model {a.model}, {a.rows} rows, max_tokens {a.max_tokens}, {a.repeats} runs each, alternating")
    for mode in ("off", "on"):
        print(f"metrics {mode:>3}: s/pass " + ", ".join(f"{w:.4f}" for w, _ in runs[mode])
              + f" over {runs[mode][0][1]} passes")
    print(f"median wall s/pass: off {off:.4f}, on {on:.4f}: {100 * (on / off - 1):+.2f}%")
    print(f"coordinator work per pass {work['coordinator'] * 1e6:.0f} us ({100 * work['coordinator'] / off:.3f}% of a pass); "
          f"streamer work per pass {work['streamer'] * 1e6:.1f} us ({100 * work['streamer'] / off:.4f}%); "
          f"one scrape {work['scrape'] * 1e3:.2f} ms (every 15 s: {100 * work['scrape'] / 15:.4f}% of a core)")


if __name__ == "__main__":
    main()
