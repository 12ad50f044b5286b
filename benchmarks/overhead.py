"""What the group and its observability add to pass time, on one job through the embedded group.

    python benchmarks/overhead.py hops    [--model FOLDER] [--rows 32] [--max-tokens 12]
    python benchmarks/overhead.py observe [--model FOLDER] [--rows 32] [--max-tokens 24] [--repeats 10]

hops: the same rows through the streamer core in-process, then as a job through the group
(coordinator, tokenizer, admission, streamer over ZeroMQ); time per pass is the wall time from the
first to the last pass over the passes between, so it includes every hop.

observe: the same job `--repeats` times in each of two set-ups, interleaved in ABBA order:
  on:  metrics and logging at their defaults (the endpoint served and scraped every --scrape-s,
       SPILL_LOG_LEVEL=info: the per-pass log lines);
  off: SPILL_METRICS_PORT=0 (no endpoint, no scrape) and SPILL_LOG_LEVEL=warning.
A run's pass time is the median of the streamer's own PASS seconds (the job's passes.jsonl); the
report gives each set-up's median and spread, the paired on/off ratio with a bootstrap interval,
each process's CPU seconds per pass, and the work itself timed in one process: the coordinator's
telemetry per pass (a PASS and a BUDGET report, the `pass` log line) and one scrape.
The model defaults to llama `small` (built under /tmp/spill-bench when missing): short passes, so
the fixed per-pass work weighs the most.
"""

import argparse
import json
import os
import random
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

PROMPT = "Question {i}: say something about the number {n}."


def through_group(folder: Path, rows: int, max_tokens: int) -> dict:
    """One job through a fresh embedded group: its last status, its PASS records, CPU s per pass by actor."""
    import psutil

    from spill import config
    from spill import messages as m
    from spill.coordinator import history
    from spill.coordinator.client import Client, endpoints, start_group
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "in.jsonl"
        inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": PROMPT.format(i=i, n=i * 7),
                                           "max_tokens": max_tokens}) + "\n" for i in range(rows)))
        eps = endpoints()
        group, client = start_group(eps, embedded=True), Client(eps)
        first = None   # (passes, CPU seconds by actor) when the first pass was seen
        try:
            info = client.request(m.SubmitJob(str(folder), str(inp), str(Path(tmp) / "out.jsonl"), max_tokens, 0.0,
                                              new=True, stream=True, client=str(os.getpid())), timeout_s=600)   # as the core alone
            while (s := client.request(m.Status(info.job, str(os.getpid())))).status != "done":
                if first is None and s.passes:
                    first = (s.passes, _cpu(psutil, s.processes))
                time.sleep(0.2)
            cpu = _cpu(psutil, s.processes)
        finally:
            client.request(m.Down())
            group.wait()
    passes = history.read(config.home() / "jobs" / info.job)
    n = s.passes - first[0]
    return {"status": s, "passes": passes, "cpu": {a: (cpu[a] - first[1].get(a, 0.0)) / n for a in cpu}}


def _cpu(psutil, pids: dict) -> dict:
    out = {}
    for actor, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        out[actor] = t.user + t.system
    return out


def core_alone(folder: Path, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from spill.streamer.core import Row, Streamer
    s = Streamer(folder)
    for i, p in enumerate(prompts):
        s.add(Row(i, p, max_tokens))
    stamps = []
    while not s.idle:
        s.step()
        stamps.append(time.monotonic())
    s.close()
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1), len(stamps)


def hops(a) -> None:
    from mlx_lm.tokenizer_utils import load
    tok = load(Path(a.model))
    prompts = [tok.encode(PROMPT.format(i=i, n=i * 7)) for i in range(a.rows)]
    s = through_group(Path(a.model), a.rows, a.max_tokens)["status"]
    core_s, core_n = core_alone(Path(a.model), prompts, a.max_tokens)
    group_s = s.wall_per_pass_s
    print(f"model {a.model}, {a.rows} rows, max_tokens {a.max_tokens}")
    print(f"core alone:    {core_s:.3f} s/pass over {core_n} passes")
    print(f"through group: {group_s:.3f} s/pass over {s.passes} passes")
    print(f"hop overhead:  {100 * (group_s / core_s - 1):+.1f}% of pass time")


# -- observe --------------------------------------------------------------------------------------
def observed_run(a, on: bool) -> dict:
    """One job with metrics and logging on (scraped) or off; the median of its PASS seconds."""
    port = _free_port() if on else 0
    os.environ["SPILL_METRICS_PORT"] = str(port)
    os.environ["SPILL_LOG_LEVEL"] = "info" if on else "warning"
    stop, scrapes = threading.Event(), []

    def scrape():
        while not stop.wait(a.scrape_s):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
                scrapes.append(1)
            except OSError:
                pass   # the group not up yet, or gone
    if on:
        threading.Thread(target=scrape, daemon=True).start()
    try:
        r = through_group(Path(a.model), a.rows, a.max_tokens)
    finally:
        stop.set()
    seconds = [p["seconds"] for p in r["passes"][1:]]   # the first pass prefills every prompt
    return {"median": statistics.median(seconds), "passes": len(seconds), "cpu": r["cpu"], "scrapes": len(scrapes)}


def work_per_pass(n: int = 2000) -> dict:
    """Seconds of the coordinator's telemetry per pass (a PASS and a BUDGET report fed, the `pass`
    log line written to a file) and of one scrape, timed in this process."""
    from prometheus_client import generate_latest

    from spill import messages as m
    from spill import metrics as mt
    from spill.actor import setup_logging
    from spill.coordinator.telemetry import Telemetry
    os.environ["SPILL_METRICS_PORT"], os.environ["SPILL_LOG_LEVEL"] = "0", "info"   # the registry timed directly
    log = setup_logging("bench-coordinator")
    run = SimpleNamespace(pending=set(range(64)), job=SimpleNamespace(id="bench", counts=lambda: {"succeeded": 0, "failed": 0}),
                          model_name="bench", left_at_start=64, started=time.monotonic(), finished=False,
                          estimate=None, passes=0, live_eta=lambda: 30.0)
    group = SimpleNamespace(box=SimpleNamespace(send=lambda *a: None), sup=SimpleNamespace(pids=lambda: {}, restarts={}),
                            epoch=1, current=run)
    tele = Telemetry(group, log)
    msg = m.Pass(1, 0, 0.05, 0.01, 0.04, 32, 16, 32, [], 10**8, 2 * 10**8, 6 * 10**7, cgroup_usage=10**9,
                 minor_faults=100, major_faults=1, read_bandwidth=1.2e9)
    budget = m.Budget(1, 0, 2 * 10**10, 10**10, 11 * 10**9, 12 * 10**9, 10**8, 0, 0, 3e9)
    t0 = time.perf_counter()
    for i in range(n):
        msg.index = budget.index = i
        tele.on_actor(msg)
        tele.on_actor(budget)
        tele.update()
    coordinator = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(50):
        generate_latest(mt.REGISTRY)
    return {"coordinator": coordinator, "scrape": (time.perf_counter() - t0) / 50}


def _spread(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"median {statistics.median(xs):.4f}, IQR {q[0]:.4f}-{q[2]:.4f}, range {min(xs):.4f}-{max(xs):.4f}"


def _bootstrap(ratios: list[float], n: int = 10000) -> tuple[float, float]:
    """95% interval of the median paired ratio, resampling the pairs."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def observe(a) -> None:
    runs = {True: [], False: []}
    for i in range(a.repeats):
        for on in ((False, True) if i % 2 == 0 else (True, False)):   # ABBA: drift hits both alike
            runs[on].append(observed_run(a, on))
            r = runs[on][-1]
            print(f"  run {i + 1} {'on ' if on else 'off'}: median pass {r['median']:.4f} s over {r['passes']} passes, "
                  f"{r['scrapes']} scrapes, CPU ms/pass " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in r["cpu"].items()),
                  flush=True)
    on, off = [r["median"] for r in runs[True]], [r["median"] for r in runs[False]]
    ratios = [x / y - 1 for x, y in zip(on, off)]
    lo, hi = _bootstrap(ratios)
    print(f"model {a.model}, {a.rows} rows, max_tokens {a.max_tokens}, {a.repeats} runs each, ABBA, "
          f"scraped every {a.scrape_s:g} s when on")
    print(f"metrics+logging on:  s/pass {_spread(on)}")
    print(f"metrics+logging off: s/pass {_spread(off)}")
    print(f"paired on/off - 1:   median {100 * statistics.median(ratios):+.2f}%, 95% bootstrap interval "
          f"{100 * lo:+.2f}% to {100 * hi:+.2f}%, each: " + ", ".join(f"{100 * x:+.1f}%" for x in ratios))
    for actor in runs[True][0]["cpu"]:
        c_on = statistics.median(r["cpu"][actor] for r in runs[True])
        c_off = statistics.median(r["cpu"][actor] for r in runs[False])
        print(f"CPU s/pass {actor:<12} on {c_on:.4f}, off {c_off:.4f}")
    work, base = work_per_pass(), statistics.median(off)
    print(f"coordinator telemetry per pass {work['coordinator'] * 1e6:.0f} us ({100 * work['coordinator'] / base:.3f}% "
          f"of a median pass); one scrape {work['scrape'] * 1e3:.2f} ms (every 15 s: {100 * work['scrape'] / 15:.4f}% "
          "of a core)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if os.environ.get("LD_PRELOAD") != preload_env().get("LD_PRELOAD"):
        os.execve(sys.executable, [sys.executable, *sys.argv], preload_env())
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("hops", "observe"))
    p.add_argument("--model", default="/tmp/spill-bench/llama-small-bfloat16-seed0")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=None, help="default 12 (hops), 24 (observe)")
    p.add_argument("--repeats", type=int, default=10, help="observe: runs of each set-up")
    p.add_argument("--scrape-s", type=float, default=1.0, help="observe: seconds between scrapes when on")
    a = p.parse_args()
    a.max_tokens = a.max_tokens or {"hops": 12, "observe": 24}[a.what]
    os.environ.setdefault("SPILL_HOME", tempfile.mkdtemp(prefix="spill-overhead-"))
    if not Path(a.model).exists():
        from spill.factory import make_model
        make_model(a.model, family="llama", size="small", seed=0, dtype="bfloat16")
    {"hops": hops, "observe": observe}[a.what](a)


if __name__ == "__main__":
    main()
