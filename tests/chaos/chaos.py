"""Chaos trials against real `spill run` processes (issue 8). By hand, 20 trials of each scenario:

    python -m tests.chaos.chaos --trials 20 --report chaos.json

CI runs one of each through tests/chaos/test_chaos.py. Every trial ends with the same check: each
custom_id is in the output exactly once, with the text a clean run gives, and every line that was
on disk when the fault hit is still there, byte for byte.

    kill      SIGKILL of a random group process (coordinator, tokenizer, admission, streamer) at a random
              moment of a 3-tier job (short, medium, long prompts); resume when the run stopped
    stop      SIGSTOP of the streamer: the liveness deadline (SPILL_LIVENESS_TIMEOUT) restarts it
    disk      the output's filesystem (a small tmpfs) fills up mid-job: one sentence; resume once there is room
    readonly  the output's filesystem turns read-only mid-run: one sentence; resume after it is writable
    home      SPILL_HOME on a read-only filesystem: one sentence, no traceback
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from spill import config

TIERS = [("short", "Name a colour.", 4), ("medium", "Summarise this: " + "the river runs to the sea. " * 20, 8),
         ("long", "Translate this: " + "a quiet morning over the hills and the town. " * 60, 12)]
FAST = {"SPILL_MAX_ROWS": "4", "SPILL_TEST_PASS_DELAY": "0.05", "SPILL_STREAM": "1"}   # streamed, as in the tests


def write_job(path: Path, per_tier: int = 4) -> list[dict]:
    rows = []
    for tier, text, max_tokens in TIERS:
        for i in range(per_tier):
            rows.append({"custom_id": f"{tier}-{i}", "prompt": f"{i}. {text}", "max_tokens": max_tokens})
    random.Random(0).shuffle(rows)    # the tiers interleave, as a real job's do
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def spill(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spill.coordinator.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **FAST, **(env or {})})


def start(model: Path, inp: Path, out: Path, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spill.coordinator.cli", "run", str(model), str(inp), "-o", str(out),
                             "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **FAST, **(env or {})})


def output_lines(out: Path) -> list[bytes]:
    """The complete lines on disk now (a torn tail is not a written row)."""
    try:
        data = out.read_bytes()
    except OSError:
        return []
    return data[: data.rfind(b"\n") + 1].splitlines(keepends=True)


def wait_for_rows(out: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while len(output_lines(out)) < n and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)


def _descends(pid: int, root: int) -> bool:
    """pid is root's child or grandchild (so a recycled pid of someone else's is never signalled)."""
    for _ in range(3):
        if pid == root:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return pid == root


def wait_group(home: Path, proc: subprocess.Popen, timeout: float = 180) -> dict[str, int]:
    """The pids of the group this `spill run` started, once all four are up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        pids = {r: p for r, p in group_pids(home).items() if _descends(p, proc.pid)}
        if len(pids) == 4:
            return pids
        time.sleep(0.05)
    return {}


def _coordinator_log(home: Path) -> list[dict]:
    from tests.coordinator.group_util import log_events
    return log_events("coordinator", home)


def group_pids(home: Path) -> dict[str, int]:
    """The newest group's pids from the coordinator's log and pid file."""
    pids = {}
    for event in _coordinator_log(home):
        if event.get("event") == "started":
            pids[event["role"]] = event["actor_pid"]
    with_pid = home / "run" / "coordinator.pid"
    if with_pid.exists():
        pids["coordinator"] = int(with_pid.read_text())
    return pids


def finish(proc: subprocess.Popen, out: Path, env=None, fix=lambda: None) -> dict:
    """Wait for the run; while it stopped with an error, apply `fix` and resume (or, when it stopped before
    it named the job, run the same command again). What the user saw, in figures."""
    stdout, stderr = proc.communicate(timeout=300)
    said = [line for line in stderr.splitlines() if line.startswith("spill: ")]
    tracebacks = stderr.count("Traceback")
    resumes = 0
    while proc.returncode != 0 and resumes < 3:
        job = stdout.split()[1].rstrip(":") if stdout.startswith("job ") else None
        fix()
        resumes += 1
        again = spill("run", "--resume", job, "--quiet", env=env) if job else spill(*proc.args[3:], env=env)
        stdout, proc.returncode = again.stdout, again.returncode
        said += [line for line in again.stderr.splitlines() if line.startswith("spill: ")]
        tracebacks += again.stderr.count("Traceback")
    return {"exit": proc.returncode, "resumes": resumes, "said": said[:3], "tracebacks": tracebacks}


def check(out: Path, expected: dict[str, str], before: list[bytes]) -> dict:
    """Rows lost, duplicated, wrong, and lines written before the fault that changed."""
    lines = output_lines(out)
    ids = [json.loads(x)["custom_id"] for x in lines]
    got = {}
    for x in lines:
        row = json.loads(x)
        body = (row.get("response") or {}).get("body") or {}
        choice = (body.get("choices") or [{}])[0]
        got[row["custom_id"]] = choice.get("text", (choice.get("message") or {}).get("content"))
    return {"rows": len(set(ids)), "lost": len(set(expected) - set(ids)), "duplicated": len(ids) - len(set(ids)),
            "wrong": sum(got.get(cid) != text for cid, text in expected.items() if cid in got),
            "changed": sum(a != b for a, b in zip(before, lines)) + max(0, len(before) - len(lines))}


@contextmanager
def tmpfs(size: str):
    """A small filesystem we can fill or make read-only (needs root: mount)."""
    where = Path(tempfile.mkdtemp(prefix="spill-chaos-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True,
                   capture_output=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
        where.rmdir()


def remount(where: Path, options: str) -> None:
    for _ in range(50):                     # busy while a row is being appended
        if subprocess.run(["mount", "-o", f"remount,{options}", str(where)], capture_output=True).returncode == 0:
            return
        time.sleep(0.02)
    raise RuntimeError(f"could not remount {where} {options}")


# -- the scenarios: each returns one trial's figures ----------------------------------------------
def trial_kill(model, inp, expected, work: Path, rng: random.Random) -> dict:
    out, home = work / "out.jsonl", config.home()
    proc = start(model, inp, out)
    pids = wait_group(home, proc)
    wait_for_rows(out, rng.randint(0, len(expected) - 2), proc)
    victim = rng.choice(["coordinator", "tokenizer", "admission", "streamer"])
    time.sleep(rng.uniform(0, 0.5))
    if victim in pids and _descends(pids[victim], proc.pid):
        os.kill(pids[victim], signal.SIGKILL)
    else:
        victim = "none (the job ended first)"
    before = output_lines(out)
    return {"victim": victim, "at_row": len(before), **finish(proc, out), **check(out, expected, before)}


def trial_stop(model, inp, expected, work: Path, rng: random.Random) -> dict:
    out, home = work / "out.jsonl", work / "home"      # a data home of its own: its logs are this group's alone
    env = {"SPILL_LIVENESS_TIMEOUT": "5", "SPILL_HOME": str(home)}
    if (config.home() / "calibration").is_dir():   # the model's calibration: no probe in this group
        shutil.copytree(config.home() / "calibration", home / "calibration")
    proc = start(model, inp, out, env)
    pids = wait_group(home, proc)
    wait_for_rows(out, rng.randint(1, len(expected) - 2), proc)
    stopped = _descends(pids["streamer"], proc.pid)
    if stopped:
        os.kill(pids["streamer"], signal.SIGSTOP)
    stopped_at = time.monotonic()
    before = output_lines(out)
    result = finish(proc, out, env)
    hung = sum(e.get("event") == "actor hung; killing it" for e in _coordinator_log(home))
    return {"victim": "streamer (SIGSTOP)" if stopped else "none (the job ended first)", "at_row": len(before), "seconds_to_finish": round(time.monotonic() - stopped_at, 1),
            "hung_restarts": hung, **result, **check(out, expected, before)}


def trial_disk(model, inp, expected, work: Path, rng: random.Random) -> dict:
    with tmpfs("1m") as fs:                 # roomy at submit (the up-front disk check passes), then filled
        out = fs / "out.jsonl"
        proc = start(model, inp, out)
        wait_for_rows(out, rng.randint(1, len(expected) - 2), proc)
        filler = fill(fs / "filler")
        before, size = output_lines(out), out.stat().st_size
        result = finish(proc, out, fix=filler.unlink)
        # a full tmpfs still takes appends into the output's last page: what fitted there met no ENOSPC
        return {"at_row": len(before), "slack": -size % os.sysconf("SC_PAGE_SIZE"),
                "grew": out.stat().st_size - size, **result, **check(out, expected, before)}


def fill(path: Path) -> Path:
    """Write zeros until the filesystem is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, bytes(4096)):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    return path


def trial_readonly(model, inp, expected, work: Path, rng: random.Random) -> dict:
    with tmpfs("1m") as fs:
        out = fs / "out.jsonl"
        proc = start(model, inp, out)
        wait_for_rows(out, rng.randint(1, len(expected) - 2), proc)
        remount(fs, "ro")
        before = output_lines(out)
        result = finish(proc, out, fix=lambda: remount(fs, "rw"))
        return {"at_row": len(before), **result, **check(out, expected, before)}


def trial_home(model, inp, expected, work: Path, rng: random.Random) -> dict:
    with tmpfs("1m") as fs:
        remount(fs, "ro")
        run = spill("run", model, inp, "-o", work / "out.jsonl", env={"SPILL_HOME": str(fs / "home")}, timeout=120)
        return {"exit": run.returncode, "said": run.stderr.strip().splitlines()[:3],
                "tracebacks": run.stderr.count("Traceback")}


SCENARIOS = {"kill": trial_kill, "stop": trial_stop, "disk": trial_disk, "readonly": trial_readonly,
             "home": trial_home}


def run_trials(scenario: str, trials: int, model: Path, work: Path, expected: dict, inp: Path, seed: int = 0) -> list[dict]:
    rng, results = random.Random(seed), []
    for k in range(trials):
        trial = work / f"{scenario}-{k}"
        trial.mkdir(parents=True)
        started = time.monotonic()
        results.append({"scenario": scenario, "trial": k, **SCENARIOS[scenario](model, inp, expected, trial, rng),
                        "seconds": round(time.monotonic() - started, 1)})
        print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    from spill.factory import make_model
    from tests.coordinator.group_util import resident_texts
    work = Path(tempfile.mkdtemp(prefix="spill-chaos-"))
    os.environ.setdefault("SPILL_HOME", str(work / "home"))
    model = make_model(work / "model", family="llama", size="tiny", seed=0, dtype="bfloat16")
    rows = write_job(work / "in.jsonl")
    expected = resident_texts(model, rows)
    results = [r for s in args.scenarios.split(",") for r in run_trials(s, args.trials, model, work, expected, work / "in.jsonl")]
    if args.report:
        args.report.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
