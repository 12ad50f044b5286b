"""A submitted job's estimate, made while the coordinator goes on answering: the rows' real token counts, the
model's calibration at its first use here (the probes), the advice and the pre-run figure (estimate.py
job_estimate).

    submit ──▶ `estimating` ──▶ done: `queued` with its estimate and advice ──▶ `running`
                            ├─▶ its process died pricing: `queued` without one, a note to the job saying so
                            └─▶ cannot be made (a model that cannot be read): `failed` with that sentence

Each runs in a child process of the coordinator (lengths.py; SPILL_ESTIMATE_APART=0: a thread), one at a time:
nothing it loads stays with the group, and admission's measure of the group (the coordinator and its children)
holds it while it runs. A job starts only once its estimate is done, so admission finds the model's calibration
stored and never probes (loads MLX) itself; a first-use probe, which runs a streamer of its own, starts only for
the job next in line with no job running, so it never runs beside a job's streamer outside that job's budget.
"""

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

from spill import config
from spill.errors import SpillError, one_line

PROBING = "calibrating this model on this machine (first use)"


def work(ask: dict, cancelled: threading.Event | None = None) -> dict:
    """One job's estimate: {"estimate": JobEstimate.to_wire() or None, "notes": warnings to log} or {"error": why}."""
    from .estimate import job_estimate
    (cancelled or threading.Event()).wait(config.test_estimate_delay())
    notes: list[dict] = []
    try:
        est = job_estimate(Path(ask["folder"]), Path(ask["input"]), set(ask["pending"]), ask["defaults"], ask["args"],
                           _Notes(notes), others=ask["others"], widen=ask.get("idle", False))
    except SpillError as err:
        return {"error": str(err)}
    except Exception as err:  # noqa: BLE001 - the job's error with the traceback logged, never the group's
        return {"error": f"the job's estimate could not be made ({one_line(err)}); see "
                         f"{config.home() / 'run' / 'logs' / 'coordinator.log'}", "traceback": traceback.format_exc()}
    return {"estimate": est.to_wire() if est is not None else None, "notes": notes}


class _Notes:
    """job_estimate's log, kept for the coordinator's (the child's own output is not read)."""

    def __init__(self, notes: list):
        self.notes = notes

    def warning(self, event: str, **fields) -> None:
        self.notes.append({"event": event, **fields})


class Estimating:
    """One job's estimate: waiting, then running in a child (or a thread); poll() is its outcome once done."""

    def __init__(self, ask: dict, probe: bool):
        self.ask, self.probe = ask, probe          # probe: the model has no calibration here yet
        self.proc: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        self.dir: Path | None = None
        self.outcome: dict | None = None
        self.cancelled = threading.Event()

    @property
    def started(self) -> bool:
        return self.proc is not None or self.thread is not None

    def start(self, idle: bool = False) -> None:
        """`idle`: no job runs, so the estimate may probe a calibration at the job's batch (a streamer beside a
        running job's would take its memory)."""
        self.ask["idle"] = idle
        if not config.estimate_apart():
            self.thread = threading.Thread(target=self._here, name="estimate", daemon=True)
            self.thread.start()
            return
        self.dir = Path(tempfile.mkdtemp(prefix="spill-estimate-"))
        from spill.platform import learn_device
        (self.dir / "ask.json").write_text(json.dumps({**self.ask, "device": learn_device()}))
        with open(self.dir / "said.txt", "wb") as said:   # the child's own output, read only when it fails
            self.proc = subprocess.Popen([sys.executable, "-m", "spill.coordinator.lengths", str(self.dir)],
                                         stdin=subprocess.DEVNULL, stdout=said, stderr=subprocess.STDOUT)

    def _here(self) -> None:
        try:
            self.outcome = work(self.ask, self.cancelled)
        except BaseException as err:  # noqa: BLE001 - a thread's end is its outcome, whatever ended it
            self.outcome = {"error": f"the job's estimate could not be made ({one_line(err)})"}

    def poll(self) -> dict | None:
        if self.outcome is None and self.proc is not None and self.proc.poll() is not None:
            self.outcome = self._read()
        return self.outcome

    def _read(self) -> dict:
        try:
            return json.loads((self.dir / "out.json").read_text())
        except (OSError, ValueError):   # it died pricing (the OOM killer's SIGKILL, a crash): a resume would too
            said = (self.dir / "said.txt").read_text(errors="replace").strip().splitlines() or ["no output"]
            code = self.proc.returncode
            how = f"was killed (signal {-code}; out of memory?)" if code < 0 else f"stopped (exit code {code})"
            return {"estimate": None, "notes": [{"event": "no estimate", "said": "\n".join(said[-20:])}],
                    "lost": f"no estimate: its process {how}; the job runs without one"}
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def stop(self) -> None:
        self.cancelled.set()   # a thread's test delay ends; its outcome is dropped
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


class Estimates:
    """The jobs being estimated, in the order they were submitted (job id -> its run and estimate)."""

    def __init__(self):
        self.jobs: dict[str, tuple[object, Estimating]] = {}

    def ask(self, run, folder: Path, args: dict, others: int) -> None:
        """Estimate `run`'s pending rows (`args`: the submit's, with the group's memory; `others`: the group's
        own memory as admission prices it, measured here: the child is not the coordinator)."""
        from .first_use import calibrated
        ask = {"folder": str(folder), "input": str(args["input"]), "pending": sorted(run.pending),
               "defaults": run.defaults, "others": others,
               "args": {k: args.get(k) for k in ("memory", "budget_fraction", "stream", "model", "kv_bits", "kv_group_size",
                                                  "stages", "micro_batches", "hosts")}}
        from spill.streamer.shares import kv_setting
        kv = kv_setting(args)
        self.jobs[run.job.id] = (run, Estimating(ask, probe=not calibrated(folder, kv)))

    def __contains__(self, run) -> bool:
        return run.job.id in self.jobs

    def check(self, head) -> list[tuple[object, dict]]:
        """The (run, outcome) of each estimate done; then, none running, the next that may start: a probe only
        for `head`, the job next in line with no job running (None while one runs)."""
        done = [(run, {**out, "folder": Path(e.ask["folder"])}) for run, e in list(self.jobs.values())
                if (out := e.poll()) is not None]
        for run, _ in done:
            del self.jobs[run.job.id]
        if not any(e.started for _, e in self.jobs.values()):
            for run, e in self.jobs.values():
                if not e.probe or run is head:
                    e.start(idle=run is head)
                    break
        return done

    def stop(self, run) -> None:
        if (entry := self.jobs.pop(run.job.id, None)) is not None:
            entry[1].stop()

    def phase(self, run) -> str | None:
        """What `spill status` says of a job being estimated (None for one that is not)."""
        if (entry := self.jobs.get(run.job.id)) is None:
            return None
        e = entry[1]
        if e.probe:
            return PROBING if e.started else "the model is calibrated once no job runs (first use)"
        return "counting the rows' tokens" if e.started else "waiting for the estimate of the job ahead"
