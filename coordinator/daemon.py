"""The coordinator process: starts and watches the actors, queues jobs, writes results, answers clients.

    spill run/status/down ──REQ/REP──▶ control socket
    actors ──PUSH──▶ coordinator inbox: READY, PASS, DONE, ERROR, PROGRESS, BUDGET
    coordinator ──▶ tokenizer: RESET, SUBMIT; admission, streamer: RESET

An actor that dies is restarted; once it is READY the group is reset (a new epoch) and every
unfinished row of the running job is submitted again: in-flight rows are recomputed from prompts.
"""

import os
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import fields
from pathlib import Path

import zmq

from spill import config, messages as m
from spill.actor import Fault, parent_watch, run_actor
from spill.errors import SpillError, one_line
from spill.memory import describe
from spill.wire import Mailbox

from .batch_output import bad_row_line
from .clients import check_clients
from .control import open_control, reply_frame
from .estimate import JobEstimate, group_others
from .estimating import Estimates
from .jobrun import JobRun
from .jobstore import Job
from .liveness import check_actors
from .metrics_line import metrics_line
from .models import warning
from .rundir import LOCKED_EXIT, lock as lock_run_dir, remove_sockets, write_record, clear_record
from .submit import prepare
from .supervisor import ACTORS, Supervisor
from .telemetry import Telemetry

END_GRACE_S = 5.0   # a stopping group waits this long at most for clients to see how their jobs ended


class Group:
    def __init__(self, box: Mailbox, sup: Supervisor, log):
        self.box, self.sup, self.log = box, sup, log
        self.epoch, self.model, self.split = 0, "", (False, False)   # the last job's model, split and replicas (kept)
        self.queue: deque[tuple[JobRun, Path]] = deque()
        self.current: JobRun | None = None
        self.job_epoch: int | None = None         # the running job's first epoch: older results are not its own
        self.last: dict[str, dict] = {}          # final status of jobs that ended in this group
        self.crashes: dict[str, int] = {}         # actor restarts during the running job
        self.waiting, self.waiting_since = set(ACTORS), time.monotonic()   # actors not READY yet, since when
        self.stirred = time.monotonic()           # the running job's rows last (re)submitted: check_stalled
        self.ready_rss: dict[str, tuple] = {}     # each actor's resident memory at its READY: (all, file pages)
        self.running = True
        self.stop_at: float | None = None        # `spill down`, or an embedded group left idle: stop then
        self.clients: dict[str, tuple[str, float]] = {}   # job -> (its client, when it last asked); until it saw the end
        self.owner = ""                           # embedded group: the `spill run` that started it
        self.owner_gone = threading.Event()       # set when that client's pipe closes: stop when idle
        self.memory = describe(sup.args)         # working set, its source, the budget
        self.metrics = ""                         # where the metrics are served, or why not (metrics_line)
        self.fault = Fault("coordinator")         # tests: SPILL_TEST_CRASH_COORDINATOR="done:n" or "submit:n"
        self.estimates = Estimates()              # queued jobs whose estimate is not made yet: `estimating`

    # -- actors -----------------------------------------------------------------------------
    def on_actor(self, msg) -> None:
        """One actor message; whatever goes wrong handling it fails the running job, never the group."""
        try:
            self._on_actor(msg)
        except Exception as err:  # noqa: BLE001 - a write that failed, a bug: the job's error, not ours
            self.log.error("actor message failed", kind=type(msg).__name__, traceback=traceback.format_exc())
            if self.current is not None:
                self.fail(str(err) if isinstance(err, SpillError) else
                          f"the coordinator could not handle a {type(msg).__name__} message ({one_line(err)}); "
                          f"see {config.home() / 'run' / 'logs' / 'coordinator.log'} and resume the job")

    def _on_actor(self, msg) -> None:
        if isinstance(msg, (m.Ready, m.Heartbeat)):
            self.sup.beat(msg.role, msg.pid, *((msg.progress, msg.busy) if isinstance(msg, m.Heartbeat) else ()))
        if isinstance(msg, m.Ready):
            self.waiting.discard(msg.role)
            self.ready_rss[msg.role] = (msg.rss, msg.file)
            if msg.role == "streamer":
                self.sup.ring.ready(msg.hosts)   # a pipeline's followers' memory: admission prices each stage on its own
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
            self.sup.ring.observe(msg.stages)
        elif isinstance(msg, m.Progress) and msg.epoch == self.epoch:
            job.on_progress(msg)
        elif isinstance(msg, m.Budget):
            job.on_budget(msg)
        for submit in job.refill(self.epoch) if isinstance(msg, (m.Done, m.Error)) else ():
            self.box.send("tokenizer", submit)   # rows finished: feed the window
        if job.finished:
            job.job.set_status("done", summary=job.summary())
            job.job.close()
            self.last[job.job.id] = self._status_of(job)
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
        self.last[run.job.id] = self._status_of(run)
        self.log.error("job failed", job=run.job.id, error=why)
        self.current = None
        self.epoch += 1
        self._broadcast_reset()

    def check_actors(self) -> None:
        check_actors(self)

    def _broadcast_reset(self, model: str = "") -> None:
        self.split = (self.current.by_compute, self.current.replicas) if model else self.split
        for role in ACTORS:
            self.box.send(role, m.Reset(self.epoch, model, self.current.job.id if self.current else "",
                                        *self.ready_rss.get("streamer", (0, 0)),   # runtime, runtime_file
                                        resident=bool(model) and self.current.resident,   # a model: a job runs
                                        **dict(zip(("kv_bits", "kv_group_size"), self.current.kv if model else (0, 64))),
                                        speculate=self._drafts() if model else 0,
                                        draft=self.current.draft if model else "",
                                        stages=self.sup.args.get("stages", 1),
                                        by_compute=bool(model) and self.current.by_compute,
                                        replicas=bool(model) and self.current.replicas,
                                        hosts=self.sup.ring.memories))

    def _drafts(self) -> int:
        """The job's --speculate; none on a pipeline group (its stages verify no drafts yet), said once to the job."""
        ranks = self.sup.args.get("stages", 1)
        if not self.current.speculate or ranks == 1:
            return self.current.speculate
        note = f"drafts are off on a group of {ranks} ranks: its ranks verify none yet"
        if note not in self.current.notes:
            self.current.notes.append(note)
            self.log.info(note, job=self.current.job.id)
        return 0

    def _restart_rows(self) -> None:
        """(Re)start the current job's unfinished rows on a fresh epoch."""
        self.epoch, self.stirred = self.epoch + 1, time.monotonic()
        if self.job_epoch is None:
            self.job_epoch = self.epoch
        self._broadcast_reset(self.model)
        for submit in self.current.submits(self.epoch):
            self.box.send("tokenizer", submit)

    # -- jobs ---------------------------------------------------------------------------------
    def next_job(self) -> None:
        if self.current is not None or not self.queue or self.queue[0][0] in self.estimates:
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
            self.fail(str(err) if isinstance(err, SpillError) else f"the job could not start ({one_line(err)})")

    def submit(self, req: m.SubmitJob) -> m.Queued:
        args = {f.name: getattr(req, f.name) for f in fields(req) if f.name != "token"}
        s = prepare(args, self.sup.args, self.ready_rss, bool(self.owner))
        job, args, model, mem, requests, bad, params = s.job, s.args, s.folder, s.memory, s.requests, s.bad, s.params
        if any(run.job.id == job.id for run, _ in self.queue) or (self.current and self.current.job.id == job.id):
            raise SpillError(f"job {job.id} is already running; follow it with `spill status {job.id}`")
        job.lock()
        try:
            job.set_status("estimating", total=len(requests) + len(bad))
            job.append([bad_row_line(b) for b in bad])
            run = JobRun(job, requests, args["model"], job.meta.get("params", params))
            if run.pending:   # its estimate is made apart (estimating.py); the job waits for it, the reply does not
                self.estimates.ask(run, model, {**mem, **self.sup.layout()}, group_others(self.ready_rss))
            else:
                job.set_status("queued")
        except BaseException:
            job.close()     # not queued: a later run of the same command may take it
            raise
        self.fault.tick("submit")   # a test's crash while the client still waits for the reply
        self.queue.append((run, model))
        self.clients[job.id] = (str(args.get("client", "")), time.monotonic())
        self.last.pop(job.id, None)   # resumed in this group: its old ending is history
        self.next_job()
        return m.Queued(job.id, run.total, run.total - len(run.pending), len(bad), str(job.output_path), len(self.queue),
                        warning(model), self.metrics, job.meta.get("status"))

    def check_estimates(self) -> None:
        """Jobs whose estimate is done go on: queued with it (or without, where pricing failed), or failed with why."""
        for run, out in self.estimates.check(self.queue[0][0] if self.queue and self.current is None else None):
            for note in out.get("notes", []):
                self.log.warning(note.pop("event"), job=run.job.id, **note)
            try:
                if "error" in out:
                    raise SpillError(out["error"])
                run.estimate = JobEstimate.from_wire(out["folder"], out["estimate"]) if out["estimate"] else None
                if "lost" in out:
                    run.notes.append(out["lost"])
                run.job.set_status("queued", **({"estimate": run.estimate.to_meta()} if run.estimate else {}))
            except Exception as err:  # noqa: BLE001 - e.g. a model that cannot be read: this job fails, the group goes on
                self.log.error("no estimate; job failed", job=run.job.id, error=str(err), traceback=out.get("traceback"))
                self.stop_job(run, "failed", str(err) if isinstance(err, SpillError) else one_line(err))

    def status(self, req: m.Status) -> m.JobStatus:
        """The job asked about (the running one when none is named) with the group's processes and memory."""
        return m.JobStatus(**self._status(req), memory=self.memory, metrics=self.metrics,
                           stages=self.sup.stages(self.model or None, *self.split, self.memory),
                           joined=len(self.sup.ring.memories))

    def _status(self, req: m.Status) -> dict:
        runs = self.runs()
        wanted = req.job
        if wanted in self.clients and req.client and req.client == self.clients[wanted][0]:
            # its own client is still there (a user's `spill status JOB` is not); once it has seen the end it is done
            self.clients[wanted] = (self.clients[wanted][0], time.monotonic())
            if wanted in self.last:
                del self.clients[wanted]
        for i, run in enumerate(runs):
            if wanted in (None, run.job.id):
                ahead = [m.Ahead(r.job.id, r.total - len(r.pending), r.total) for r in runs[:i]]
                return {**self._status_of(run), "processes": self._pids(), "queued": len(self.queue), "ahead": ahead,
                        "estimating": self.estimates.phase(run)}
        if wanted in self.last:
            return {**self.last[wanted], "processes": self._pids()}
        if wanted:
            job = Job.open(wanted)
            return {"job": job.id, "status": job.meta.get("status"), "done": len(job.done_ids()),
                    "total": job.meta.get("total"), "output": str(job.output_path), **job.counts(),
                    "processes": self._pids()}
        return {"job": None, "processes": self._pids(), "queued": 0}

    def _pids(self) -> dict[str, int]:
        return {"coordinator": os.getpid(), **self.sup.pids()}

    @staticmethod
    def _status_of(run: JobRun) -> dict:
        return {**run.status(), **run.job.counts(), "error": run.job.meta.get("error")}

    # -- stopping jobs: Ctrl-C, `spill cancel`, `spill down`, a client that went away -----------------
    def runs(self) -> list[JobRun]:
        return ([self.current] if self.current else []) + [run for run, _ in self.queue]

    def stop_job(self, run: JobRun, status: str, error: str | None = None) -> m.Stopped:
        """Stop a running or queued job; what is written stays written, and it can be resumed."""
        was = run.job.meta.get("status")
        if run is self.current:
            self.current = None
            self.epoch += 1
            self._broadcast_reset()
        else:
            self.queue = deque((r, mdl) for r, mdl in self.queue if r is not run)
            self.estimates.stop(run)
        run.job.set_status(status, **({"error": error} if error else {}))
        run.job.close()
        self.last[run.job.id] = self._status_of(run)
        self.log.info("job stopped", job=run.job.id, status=status, was=was)
        return m.Stopped(run.job.id, was, run.total - len(run.pending), run.total)

    def interrupt(self, req: m.Interrupt) -> m.Stopped:
        """Stop a job at the next pass boundary (Ctrl-C in its `spill run`)."""
        for run in self.runs():
            if req.job in (None, run.job.id):
                self.clients.pop(run.job.id, None)   # the client asking is the one following it
                return self.stop_job(run, "interrupted")
        return m.Stopped(req.job)

    def cancel(self, req: m.Cancel) -> m.Stopped:
        """`spill cancel JOB`: stop a running or queued job; re-running its command does not continue it."""
        for run in self.runs():
            if run.job.id == req.job:
                return self.stop_job(run, "cancelled")
        raise SpillError(f"job {req.job} is not running or queued in this group; `spill status` lists the jobs")

    def check_clients(self) -> None:
        check_clients(self)

    def down(self, _req: m.Down) -> m.Stopping:
        stopped = [self.stop_job(run, "interrupted") for run in self.runs()]
        self.stop_at = time.monotonic()
        return m.Stopping(stopped)

    def ping(self, _req: m.Ping) -> m.Pong:
        return m.Pong(os.getpid())

    def handle(self, req):
        """Every request gets a reply: its own, or Refused with one sentence of what went wrong."""
        ops = {m.Ping: self.ping, m.SubmitJob: self.submit, m.Status: self.status, m.Interrupt: self.interrupt,
               m.Cancel: self.cancel, m.Down: self.down}
        if type(req) not in ops:
            return m.Refused(f"unknown request {type(req).__name__}; this group answers "
                             f"{', '.join(t.op for t in ops)} (is the client the same spill version as the group?)")
        try:
            return ops[type(req)](req)
        except SpillError as err:
            return m.Refused(str(err))
        except Exception as err:  # noqa: BLE001 - a request that breaks something gets its error, the group goes on
            self.log.error("request failed", op=req.op, traceback=traceback.format_exc())
            return m.Refused(f"{req.op} failed ({one_line(err)}); see {config.home() / 'run' / 'logs' / 'coordinator.log'}")

    @property
    def stopping(self) -> bool:
        """Down or left idle, once every client has seen how its job ended (or END_GRACE_S has passed)."""
        now = time.monotonic()
        return not self.running or (self.stop_at is not None and now >= self.stop_at
                                    and (not self.clients or now >= self.stop_at + END_GRACE_S))


def run_coordinator_process(endpoints, args, log) -> None:
    try:
        run_lock = lock_run_dir()   # one group per run directory: its sockets have fixed names
    except SpillError as err:
        print(f"spill: {err}", file=sys.stderr, flush=True)
        os._exit(LOCKED_EXIT)
    os.chdir("/")   # paths arrive resolved by the client; nothing may depend on where the group started
    box = Mailbox(endpoints, "coordinator", sends_to=tuple(ACTORS))
    settings = args.get("group_args", {})   # `spill up`'s flags
    control, token = open_control(box.ctx, endpoints.control, settings.get("allow_remote", False))
    write_record(os.getpid(), endpoints.control)
    pidfile = config.home() / "run" / "coordinator.pid"
    pidfile.write_text(str(os.getpid()))
    sup = Supervisor(endpoints, args.get("actor_args", {}), log)
    group = Group(box, sup, log)
    if args.get("owner_fd") is not None:
        group.owner = str(args.get("owner", ""))
        parent_watch(args["owner_fd"], group.owner_gone.set)   # embedded: the `spill run` that started it left
    # the metrics endpoint, fed from what the actors report
    telemetry = Telemetry(group, log, settings.get("metrics_host"), settings.get("metrics_port"))
    group.metrics = metrics_line(telemetry.server is not None, telemetry.host, telemetry.port)
    log.info("memory", **group.memory)
    sup.start_all()
    poller = zmq.Poller()
    poller.register(box.inbox, zmq.POLLIN)
    poller.register(control, zmq.POLLIN)
    try:
        while not group.stopping:
            ready = dict(poller.poll(200))
            if control in ready:
                control.send(reply_frame(group, control.recv(), token, endpoints.control, log))
            for msg in box.drain():   # after a slow request too: heartbeats are read before liveness is judged
                telemetry.on_actor(msg)
                group.on_actor(msg)
                for _row in getattr(msg, "rows", []) if isinstance(msg, m.Done) else []:
                    group.fault.tick("done")   # counts rows written
            group.check_actors()
            group.check_clients()
            group.check_estimates()
            group.next_job()
            telemetry.update()
            if group.waiting and time.monotonic() - group.waiting_since > config.ready_timeout():
                raise RuntimeError(f"actors {sorted(group.waiting)} did not start within {config.ready_timeout()} s")
    finally:
        for run in group.runs():   # Ctrl-C on `spill up --foreground`, or a crash: the jobs are interrupted
            group.stop_job(run, "interrupted")
        telemetry.linger()
        for role in ACTORS:
            box.send(role, m.Shutdown("down"))
        sup.stop_all()
        pidfile.unlink(missing_ok=True)
        control.close()
        box.close()
        remove_sockets(endpoints)
        clear_record()
        os.close(run_lock)


if __name__ == "__main__":
    run_actor("coordinator", run_coordinator_process)
