"""Soak: seeded trials of the faults a group must survive or name, each through the real `spill run`.

    python -m tests.chaos.soak --trials 30 --seed 0 --report soak.json

Trial k of seed s draws its fault, the fault's moment and the group (embedded, or a long-lived `spill up`
for about one trial in four) from Random(f"{s}:{k}"); the fault kinds take turns:

    wedge    an actor's loop blocks for ever at its n-th event (SPILL_TEST_CRASH_<ROLE>=event:n:wedge), its heartbeat
             going on; SPILL_WEDGE_TIMEOUT=20 restarts it
    drop     the n-th message of a kind is lost on its way (SPILL_TEST_DROP=KIND:n); SPILL_STALL_TIMEOUT=3
    alloc    the weight reader's first buffer fails to allocate (SPILL_TEST_ALLOC_FAIL=1[:every]), in the first
             streamer or in every one
    corrupt  the model's shard is cut short, emptied or has its header overwritten after some rows are written

A trial passes when the job finished with every custom_id exactly once and the text of a fault-free run, or
failed with one `spill: ` sentence and no traceback, the rows it wrote each once and right. A trial still
running after its cap (CAP_S) is a hang: its processes are killed and it counts as a failure.
"""

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .chaos import output_lines

CAP_S = 240   # liveness bound of a trial: the deadlines below plus a model reload each, several times over
FAST = {"SPILL_MAX_ROWS": "4", "SPILL_TEST_PASS_DELAY": "0.05", "SPILL_STREAM": "1", "SPILL_METRICS_PORT": "0"}
FAULTS = ("wedge", "drop", "alloc", "corrupt")
OUTCOMES = ("identical", "sentence", "hang", "defect")
WEDGE_S = "20"   # longer than any loop turn here: a tokenizer loading under load 11 took over 5 s, and was killed
WEDGES = {"tokenizer": ("submit", "tokens"), "admission": ("tokenized", "pass"), "streamer": ("pass",)}
DROPS = ("SUBMIT", "TOKENIZED", "PLAN", "TOKENS", "PASS", "DONE")


def write_job(path: Path, n: int = 8) -> list[dict]:
    """n rows of short and medium prompts, max_tokens 4-10: a job of ~15 passes at 4 rows a pass."""
    rows = [{"custom_id": f"r{i}", "prompt": f"{i}. " + "the river runs to the sea. " * (1 + 6 * (i % 3)),
             "max_tokens": 4 + 2 * (i % 4)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def draw(seed: int, k: int) -> dict:
    """Trial k's fault, its moment and its group, from the seed alone."""
    rng = random.Random(f"{seed}:{k}")
    fault, group = FAULTS[k % len(FAULTS)], "up" if rng.random() < 0.25 else "embedded"
    if fault == "wedge":
        role = rng.choice(sorted(WEDGES))
        event = rng.choice(WEDGES[role])
        at = 1 if event in ("submit", "tokenized") else rng.randint(1, 6)
        env = {f"SPILL_TEST_CRASH_{role.upper()}": f"{event}:{at}:wedge", "SPILL_WEDGE_TIMEOUT": WEDGE_S}
        return {"fault": fault, "group": group, "what": f"{role} {event}:{at}", "env": env}
    if fault == "drop":
        kind = rng.choice(DROPS)
        at = 1 if kind in ("SUBMIT", "TOKENIZED") else rng.randint(1, 8)
        return {"fault": fault, "group": group, "what": f"{kind}:{at}",
                "env": {"SPILL_TEST_DROP": f"{kind}:{at}", "SPILL_STALL_TIMEOUT": "3"}}
    if fault == "alloc":   # in the first streamer (a restart finds memory), or in each one (memory stays short)
        every = rng.random() < 0.5   # a streamer of the tiny llama allocates one buffer, in its first pass
        return {"fault": fault, "group": group, "what": "every streamer" if every else "the first streamer",
                "env": {"SPILL_TEST_ALLOC_FAIL": "1:every" if every else "1"}}
    how, after = rng.choice(("truncate", "empty", "header")), rng.randint(1, 6)
    return {"fault": fault, "group": group, "what": f"{how} after {after} rows", "how": how, "after": after,
            "cut": rng.uniform(0.2, 0.9), "env": {}}


def corrupt(shard: Path, how: str, cut: float) -> None:
    """The shard in place, as a download cut short, a disk that lost a file, or bytes overwritten."""
    if how == "truncate":
        os.truncate(shard, int(shard.stat().st_size * cut))
    elif how == "empty":
        os.truncate(shard, 0)
    else:
        with open(shard, "r+b") as f:
            f.seek(8)
            f.write(b"\xff" * 64)


def _pg_kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _group_pids(home: Path) -> list[int]:
    """The coordinator and actor pids a group wrote in its data home (all of them trial-own)."""
    from tests.coordinator.group_util import log_events
    pids = [e["actor_pid"] for e in log_events("coordinator", home) if e.get("event") == "started"]
    pid_file = home / "run" / "coordinator.pid"
    return pids + ([int(pid_file.read_text())] if pid_file.exists() else [])


def _kill_group(home: Path) -> None:
    for pid in _group_pids(home):
        try:
            if home.as_posix() in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)   # only a process of this trial's own data home
        except (OSError, ValueError):
            pass


def trial(t: dict, model: Path, inp: Path, reference: dict, calibration: Path, work: Path) -> dict:
    """Run one drawn trial; its figures."""
    home, out = work / "home", work / "out.jsonl"
    shutil.copytree(calibration, home / "calibration")
    if t["fault"] == "corrupt":                 # a model folder of the trial's own, to spoil
        model = Path(shutil.copytree(model, work / "model"))
    env = {**os.environ, **FAST, "SPILL_HOME": str(home), **t["env"]}
    cli = [sys.executable, "-m", "spill.coordinator.cli"]
    started, said, hung = time.monotonic(), [], False
    if t["group"] == "up":
        up = subprocess.run([*cli, "up"], env=env, capture_output=True, text=True, timeout=CAP_S)
        if up.returncode != 0:
            return {"outcome": "defect", "exit": up.returncode, "seconds": round(time.monotonic() - started, 1),
                    "said": up.stderr.strip().splitlines()[-3:]}
    proc = subprocess.Popen([*cli, "run", str(model), str(inp), "-o", str(out), "--quiet"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if t["fault"] == "corrupt":
        while len(output_lines(out)) < t["after"] and proc.poll() is None and time.monotonic() - started < CAP_S:
            time.sleep(0.02)
        corrupt(next(model.glob("*.safetensors")), t["how"], t["cut"])
    try:
        stdout, stderr = proc.communicate(timeout=max(1, CAP_S - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        hung = True
        _pg_kill(proc)
        stdout, stderr = proc.communicate()
    seconds = round(time.monotonic() - started, 1)
    if t["group"] == "up":
        down = subprocess.run([*cli, "down"], env=env, capture_output=True, text=True, timeout=120)
        said += [f"(spill down exit {down.returncode})"] if down.returncode else []
    _kill_group(home)
    return {**judge(proc.returncode, stderr, out, reference, hung), "seconds": seconds, **events(home),
            "said": said + [x for x in stderr.splitlines() if x.strip()][:4]}


def judge(code: int, stderr: str, out: Path, reference: dict, hung: bool) -> dict:
    """identical | sentence | hang | defect, and the rows behind it."""
    lines = [json.loads(x) for x in output_lines(out)]
    ids = [r["custom_id"] for r in lines]
    from tests.coordinator.group_util import texts
    got = texts({r["custom_id"]: r for r in lines if "response" in r and r["response"]})
    rows = {"rows": len(set(ids)), "duplicated": len(ids) - len(set(ids)),
            "wrong": sum(got.get(c, reference[c]) != reference[c] for c in reference),
            "errors": sum(not r.get("response") for r in lines), "tracebacks": stderr.count("Traceback")}
    clean = rows["duplicated"] == rows["wrong"] == rows["tracebacks"] == rows["errors"] == 0
    if hung:
        outcome = "hang"
    elif code == 0 and clean and set(ids) == set(reference):
        outcome = "identical"
    elif code not in (0, None) and clean and len([x for x in stderr.splitlines() if x.strip()]) == 1 \
            and stderr.startswith("spill: "):
        outcome = "sentence"
    else:
        outcome = "defect"
    return {"outcome": outcome, "exit": code, **rows}


def events(home: Path) -> dict:
    """What the coordinator did about the fault: restarts (by role), resubmissions, failed jobs."""
    from tests.coordinator.group_util import log_events
    log = log_events("coordinator", home)
    return {"restarted": [e["role"] for e in log if e.get("event") == "actor died; restarting"],
            "wedged": [e["role"] for e in log if e.get("event") == "actor hung; killing it"],
            "resubmitted": sum("submitting them again" in e.get("event", "") for e in log)}


def summary(results: list[dict]) -> list[dict]:
    """Per fault kind: trials, each outcome, median seconds."""
    rows = []
    for fault in FAULTS:
        mine = [r for r in results if r["fault"] == fault]
        if mine:
            rows.append({"fault": fault, "trials": len(mine), "up": sum(r["group"] == "up" for r in mine),
                         **{o: sum(r["outcome"] == o for r in mine) for o in OUTCOMES},
                         "median_s": statistics.median(r["seconds"] for r in mine),
                         "max_s": max(r["seconds"] for r in mine)})
    return rows


def prepare(work: Path, home: Path) -> tuple[Path, Path, dict]:
    """The tiny model, the job, and the fault-free reference: a `spill run` of the same job (its calibration
    is then in `home`); the reference equals resident mlx-lm's greedy text, or this raises."""
    from spill.factory import make_model
    from tests.coordinator.group_util import read_output, resident_texts, texts
    model = make_model(work / "model", family="llama", size="tiny", seed=0, dtype="bfloat16")
    rows = write_job(work / "in.jsonl")
    subprocess.run([sys.executable, "-m", "spill.coordinator.cli", "run", str(model), str(work / "in.jsonl"), "-o",
                    str(work / "reference.jsonl"), "--quiet"], env={**os.environ, **FAST, "SPILL_HOME": str(home)},
                   check=True, timeout=600)
    reference = texts(read_output(work / "reference.jsonl"))
    if reference != resident_texts(model, rows):
        raise SystemExit("the fault-free run differs from resident mlx-lm: no reference to soak against")
    return model, work / "in.jsonl", reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, nargs="*", help="run only these trial numbers (to replay one)")
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="spill-soak-"))
    model, inp, reference = prepare(work, work / "home")
    results = []
    for k in args.only if args.only is not None else range(args.trials):
        t = draw(args.seed, k)
        (work / f"t{k}").mkdir()
        result = {"seed": args.seed, "trial": k, **{x: t[x] for x in ("fault", "group", "what")},
                  **trial(t, model, inp, reference, work / "home" / "calibration", work / f"t{k}")}
        results.append(result)
        print(json.dumps(result), flush=True)
    for row in summary(results):
        print(json.dumps(row))
    if args.report:
        args.report.write_text(json.dumps({"trials": results, "summary": summary(results)}, indent=1))


if __name__ == "__main__":
    main()
