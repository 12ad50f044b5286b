"""The coordinator process: starts and watches the actors, queues jobs, writes results, answers clients.

    spill run/status/down ──REQ/REP──▶ control socket
    actors ──PUSH──▶ coordinator inbox: READY, PASS, DONE, ERROR, PROGRESS
    coordinator ──▶ tokenizer: RESET, SUBMIT; admission, streamer: RESET

An actor that dies is restarted; once it is READY the group is reset (a new epoch) and every
unfinished row of the running job is submitted again: in-flight rows are recomputed from prompts.
"""

import os
import time
from collections import deque
from pathlib import Path

import zmq

from spill import config
from spill import messages as m
from spill.actor import Fault, run_actor
from spill.errors import SpillError
from spill.wire import Mailbox

from .batch_input import read_batch
from .batch_output import bad_row_line
from .jobrun import JobRun
from .jobstore import Job
from .models import resolve
from .supervisor import ACTORS, Supervisor

MAX_CRASHES = 3   # restarts of one actor during one job before the job fails


class Group:
    def __init__(self, box: Mailbox, sup: Supervisor, log):
        self.box, self.sup, self.log = box, sup, log
        self.epoch = 0
        self.model = ""
        self.queue: deque[tuple[JobRun, Path]] = deque()
        self.current: JobRun | None = None
        self.last: dict[str, dict] = {}          # final status of jobs that ended in this group
        self.crashes: dict[str, int] = {}         # actor restarts during the running job
        self.waiting: set[str] = set(ACTORS)     # actors not READY yet
        self.waiting_since = time.monotonic()
        self.running = True

    # -- actors -----------------------------------------------------------------------------
    def on_actor(self, msg) -> None:
        if isinstance(msg, m.Ready):
            self.waiting.discard(msg.role)
            if not self.waiting and self.current is not None:
                self._restart_rows()
            return
        job = self.current
        if job is None:
            return
        if isinstance(msg, m.Error) and m.MODEL_ROW in msg.rows:
            if msg.epoch == self.epoch:
                self.fail(msg.messages[msg.rows.index(m.MODEL_ROW)])
            return
        if isinstance(msg, m.Done):
            job.on_done(msg)
        elif isinstance(msg, m.Error):
            job.on_error(msg)
        elif isinstance(msg, m.Pass) and msg.epoch == self.epoch:
            job.on_pass(msg)
        elif isinstance(msg, m.Progress) and msg.epoch == self.epoch:
            job.on_progress(msg)
        if job.finished:
            job.job.set_status("done")
            job.job.close()
            self.last[job.job.id] = job.status()
            self.log.info("job done", job=job.job.id)
            self.current = None

    def fail(self, why: str) -> None:
        """End the running job as failed (what is written stays written) and clear the group."""
        run = self.current
        run.job.set_status("failed", error=why)
        run.job.close()
        self.last[run.job.id] = {**run.status(), "status": "failed", "error": why}
        self.log.error("job failed", job=run.job.id, error=why)
        self.current = None
        self.epoch += 1
        self._broadcast_reset()

    def check_actors(self) -> None:
        for role, code in self.sup.dead():
            self.log.warning("actor died; restarting", actor=role, exit_code=code)
            self.crashes[role] = self.crashes.get(role, 0) + 1
            if self.current is not None and self.crashes[role] > MAX_CRASHES:
                self.fail(f"the {role} crashed {self.crashes[role]} times during this job; "
                          f"see {config.home() / 'run' / 'logs' / (role + '.log')}")
            self.sup.restart(role)
            if not self.waiting:
                self.waiting_since = time.monotonic()
            self.waiting.add(role)
            self.epoch += 1    # whatever the group holds now is stale

    def _broadcast_reset(self, model: str = "") -> None:
        for role in ACTORS:
            self.box.send(role, m.Reset(self.epoch, model, self.current.job.id if self.current else ""))

    def _restart_rows(self) -> None:
        """(Re)start the current job's unfinished rows on a fresh epoch."""
        self.epoch += 1
        self._broadcast_reset(self.model)
        for submit in self.current.submits(self.epoch):
            self.box.send("tokenizer", submit)

    # -- jobs ---------------------------------------------------------------------------------
    def next_job(self) -> None:
        if self.current is not None or not self.queue:
            return
        self.current, model = self.queue.popleft()
        self.model = str(model)
        self.crashes = {}
        self.current.job.set_status("running")
        self.log.info("job started", job=self.current.job.id, rows=len(self.current.pending))
        if self.current.finished:
            self.current.job.set_status("done")
            self.current = None
        elif not self.waiting:
            self._restart_rows()

    def submit(self, args: dict) -> dict:
        job = Job.open(args["resume"]) if args.get("resume") else None
        if job is not None:   # the job knows its input, model and output
            args = {**args, "input": args.get("input") or job.meta["input"],
                    "model": args.get("model") or job.meta["model"], "output": args.get("output") or job.meta.get("output")}
        model = resolve(args["model"])
        requests, bad = read_batch(Path(args["input"]))
        params = {"max_tokens": args.get("max_tokens") or 256, "temperature": args.get("temperature") or 0.0}
        output = Path(args["output"]) if args.get("output") else None
        if job is None and not args.get("new"):
            job = Job.find(Path(args["input"]), output, args["model"])
        if job is None:
            job = Job.create(Path(args["input"]), args["model"], params, output)
        job.check_input()
        if any(run.job.id == job.id for run, _ in self.queue) or (self.current and self.current.job.id == job.id):
            raise SpillError(f"job {job.id} is already running; follow it with `spill status {job.id}`")
        job.lock()
        job.set_status("queued", total=len(requests) + len(bad))
        job.append([bad_row_line(b) for b in bad])
        run = JobRun(job, requests, args["model"], job.meta.get("params", params))
        self.queue.append((run, model))
        self.next_job()
        return {"job": job.id, "total": run.total, "done": run.total - len(run.pending),
                "output": str(job.output_path), "queued": len(self.queue)}

    def status(self, args: dict) -> dict:
        runs = ([self.current] if self.current else []) + [run for run, _ in self.queue]
        wanted = args.get("job")
        for run in runs:
            if wanted in (None, run.job.id):
                return {**run.status(), "processes": self.sup.pids(), "queued": len(self.queue)}
        if wanted in self.last:
            return {**self.last[wanted], "processes": self.sup.pids()}
        if wanted:
            job = Job.open(wanted)
            return {"job": job.id, "status": job.meta.get("status"), "done": len(job.done_ids()),
                    "total": job.meta.get("total"), "output": str(job.output_path), "processes": self.sup.pids()}
        return {"job": None, "processes": self.sup.pids(), "queued": 0}

    def interrupt(self, args: dict) -> dict:
        """Stop a job at the next pass boundary; what is written stays written."""
        run = self.current
        if run is not None and args.get("job") in (None, run.job.id):
            run.job.set_status("interrupted")
            run.job.close()
            self.current = None
            self.epoch += 1
            self._broadcast_reset()
            return {"job": run.job.id, "done": run.total - len(run.pending), "total": run.total}
        self.queue = deque((r, mdl) for r, mdl in self.queue if r.job.id != args.get("job"))
        return {"job": args.get("job")}

    def handle(self, req: m.Request) -> m.Reply:
        ops = {"ping": lambda a: {"pid": os.getpid()}, "submit": self.submit, "status": self.status,
               "interrupt": self.interrupt, "down": self.down}
        try:
            return m.Reply(True, ops[req.op](req.args))
        except SpillError as err:
            return m.Reply(False, error=str(err))

    def down(self, _args: dict) -> dict:
        if self.current is not None:
            self.current.job.set_status("interrupted")
            self.current.job.close()
        self.running = False
        return {}


def run_coordinator_process(endpoints, args, log) -> None:
    box = Mailbox(endpoints, "coordinator", sends_to=tuple(ACTORS))
    control = box.ctx.socket(zmq.REP)
    control.setsockopt(zmq.LINGER, 1000)
    if endpoints.control.startswith("ipc://") and os.path.exists(endpoints.control[6:]):
        os.unlink(endpoints.control[6:])
    control.bind(endpoints.control)
    pidfile = config.home() / "run" / "coordinator.pid"
    pidfile.write_text(str(os.getpid()))
    sup = Supervisor(endpoints, args.get("actor_args", {}), log)
    group = Group(box, sup, log)
    fault = Fault("coordinator")
    sup.start_all()
    poller = zmq.Poller()
    poller.register(box.inbox, zmq.POLLIN)
    poller.register(control, zmq.POLLIN)
    try:
        while group.running:
            ready = dict(poller.poll(200))
            if box.inbox in ready:
                for msg in box.drain():
                    group.on_actor(msg)
                    for _row in getattr(msg, "rows", []) if isinstance(msg, m.Done) else []:
                        fault.tick("done")   # counts rows written
            if control in ready:
                control.send(m.encode(group.handle(m.decode(control.recv()))))
            group.check_actors()
            group.next_job()
            if group.waiting and time.monotonic() - group.waiting_since > config.ready_timeout():
                raise RuntimeError(f"actors {sorted(group.waiting)} did not start within {config.ready_timeout()} s")
    finally:
        for role in ACTORS:
            box.send(role, m.Shutdown("down"))
        sup.stop_all()
        pidfile.unlink(missing_ok=True)
        control.close()
        box.close()


if __name__ == "__main__":
    run_actor("coordinator", run_coordinator_process)
