"""The coordinator process: starts and watches the actors, queues jobs, writes results, answers clients.

    spill run/status/down ──REQ/REP──▶ control socket
    actors ──PUSH──▶ coordinator inbox: READY, PASS, DONE, ERROR, PROGRESS
    coordinator ──▶ tokenizer: RESET, SUBMIT; admission, streamer: RESET

An actor that dies is restarted; once it is READY the group is reset (a new epoch) and every
unfinished row of the running job is submitted again: in-flight rows are recomputed from prompts.
"""

import os
import time
import traceback
from collections import deque
from pathlib import Path

import zmq

from spill import config
from spill import messages as m
from spill.actor import Fault, run_actor
from spill.errors import SpillError
from spill.memory import check_same, describe
from spill.wire import Mailbox

from .batch_input import read_batch
from .batch_output import bad_row_line
from .control import authorized, open_control, refusal
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
        self.job_epoch: int | None = None         # the running job's first epoch: older results are not its own
        self.last: dict[str, dict] = {}          # final status of jobs that ended in this group
        self.crashes: dict[str, int] = {}         # actor restarts during the running job
        self.waiting: set[str] = set(ACTORS)     # actors not READY yet
        self.waiting_since = time.monotonic()
        self.running = True
        self.memory = describe(sup.args)         # working set, its source, the budget

    # -- actors -----------------------------------------------------------------------------
    def on_actor(self, msg) -> None:
        """One actor message; whatever goes wrong handling it fails the running job, never the group."""
        try:
            self._on_actor(msg)
        except Exception as err:  # noqa: BLE001 - a write that failed, a bug: the job's error, not ours
            self.log.error("actor message failed", kind=type(msg).__name__, traceback=traceback.format_exc())
            if self.current is not None:
                self.fail(str(err) if isinstance(err, SpillError) else
                          f"the coordinator could not handle a {type(msg).__name__} message ({_one_line(err)}); "
                          f"see {config.home() / 'run' / 'logs' / 'coordinator.log'} and resume the job")

    def _on_actor(self, msg) -> None:
        if isinstance(msg, (m.Ready, m.Heartbeat)):
            self.sup.beat(msg.role, msg.pid)
        if isinstance(msg, m.Ready):
            self.waiting.discard(msg.role)
            if not self.waiting and self.current is not None:
                self._restart_rows()
            return
        job = self.current
        if job is None or not self._ours(msg):
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
        for submit in job.refill(self.epoch) if isinstance(msg, (m.Done, m.Error)) else ():
            self.box.send("tokenizer", submit)   # rows finished: feed the window
        if job.finished:
            job.job.set_status("done")
            job.job.close()
            self.last[job.job.id] = job.status()
            self.log.info("job done", job=job.job.id)
            self.current = None

    def _ours(self, msg) -> bool:
        """A result of the running job: stamped with its id (or none) and from one of its epochs."""
        if getattr(msg, "job", "") not in ("", self.current.job.id):
            return False
        return self.job_epoch is not None and getattr(msg, "epoch", self.epoch) >= self.job_epoch

    def fail(self, why: str) -> None:
        """End the running job as failed (what is written stays written) and clear the group."""
        run = self.current
        try:
            run.job.set_status("failed", error=why)
        except Exception:  # noqa: BLE001 - job.json cannot be written either; the reply still says why
            self.log.error("job status not written", job=run.job.id, traceback=traceback.format_exc())
        run.job.close()
        self.last[run.job.id] = {**run.status(), "status": "failed", "error": why}
        self.log.error("job failed", job=run.job.id, error=why)
        self.current = None
        self.epoch += 1
        self._broadcast_reset()

    def check_actors(self) -> None:
        for role in self.sup.hung(config.liveness_timeout()):
            self.log.warning("actor hung; killing it", actor=role, deadline_s=config.liveness_timeout())
            self.sup.kill(role)
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
        if self.job_epoch is None:
            self.job_epoch = self.epoch
        self._broadcast_reset(self.model)
        for submit in self.current.submits(self.epoch):
            self.box.send("tokenizer", submit)

    # -- jobs ---------------------------------------------------------------------------------
    def next_job(self) -> None:
        if self.current is not None or not self.queue:
            return
        self.current, model = self.queue.popleft()
        self.model, self.job_epoch = str(model), None
        self.crashes = {}
        try:
            self.current.job.set_status("running")
            self.log.info("job started", job=self.current.job.id, rows=len(self.current.pending))
            if self.current.finished:
                self.current.job.set_status("done")
                self.current = None
            elif not self.waiting:
                self._restart_rows()
        except Exception as err:  # noqa: BLE001 - e.g. job.json cannot be written: this job fails, the group goes on
            self.fail(str(err) if isinstance(err, SpillError) else f"the job could not start ({_one_line(err)})")

    def submit(self, args: dict) -> dict:
        check_same(self.sup.args, args)
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
        try:
            job.set_status("queued", total=len(requests) + len(bad))
            job.append([bad_row_line(b) for b in bad])
            run = JobRun(job, requests, args["model"], job.meta.get("params", params))
        except BaseException:
            job.close()     # not queued: a later run of the same command may take it
            raise
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
        """Every request gets a reply: its data, or one sentence of what went wrong."""
        ops = {"ping": lambda a: {"pid": os.getpid()}, "submit": self.submit,
               "status": lambda a: {**self.status(a), "memory": self.memory},
               "interrupt": self.interrupt, "down": self.down}
        if req.op not in ops:
            return m.Reply(False, error=f"unknown request {req.op!r}; this group answers {', '.join(ops)} "
                                        "(is the client the same spill version as the group?)")
        try:
            return m.Reply(True, ops[req.op](req.args))
        except SpillError as err:
            return m.Reply(False, error=str(err))
        except Exception as err:  # noqa: BLE001 - a request that breaks something gets its error, the group goes on
            self.log.error("request failed", op=req.op, traceback=traceback.format_exc())
            return m.Reply(False, error=f"{req.op} failed ({_one_line(err)}); "
                                        f"see {config.home() / 'run' / 'logs' / 'coordinator.log'}")

    def down(self, _args: dict) -> dict:
        if self.current is not None:
            self.current.job.set_status("interrupted")
            self.current.job.close()
        self.running = False
        return {}


def run_coordinator_process(endpoints, args, log) -> None:
    box = Mailbox(endpoints, "coordinator", sends_to=tuple(ACTORS))
    control, token = open_control(box.ctx, endpoints.control)
    pidfile = config.home() / "run" / "coordinator.pid"
    pidfile.write_text(str(os.getpid()))
    sup = Supervisor(endpoints, args.get("actor_args", {}), log)
    group = Group(box, sup, log)
    log.info("memory", **group.memory)
    fault = Fault("coordinator")
    sup.start_all()
    poller = zmq.Poller()
    poller.register(box.inbox, zmq.POLLIN)
    poller.register(control, zmq.POLLIN)
    try:
        while group.running:
            ready = dict(poller.poll(200))
            if control in ready:
                control.send(m.encode(answer(group, control.recv(), token, endpoints.control, log)))
            for msg in box.drain():   # after a slow request too: heartbeats are read before liveness is judged
                group.on_actor(msg)
                for _row in getattr(msg, "rows", []) if isinstance(msg, m.Done) else []:
                    fault.tick("done")   # counts rows written
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


def answer(group: Group, frame: bytes, token: str, address: str, log) -> m.Reply:
    """The reply to one control frame: a bad frame or a wrong token gets an error, never silence."""
    try:
        req = m.decode(frame)
        if not isinstance(req, m.Request):
            raise m.BadMessage(f"expected a request, found {type(req).__name__}")
    except m.BadMessage as err:
        log.warning("bad control frame", why=str(err), size=len(frame))
        return m.Reply(False, error=f"not a spill request ({err})")
    if not authorized(token, req.token):
        log.warning("control request refused: wrong token", op=req.op)
        return m.Reply(False, error=refusal(address))
    return group.handle(req)


def _one_line(err: Exception) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]


if __name__ == "__main__":
    run_actor("coordinator", run_coordinator_process)
