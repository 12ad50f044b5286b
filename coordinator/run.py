"""What `spill run`, `up`, `down`, `cancel` and `status` do, as a client of the group.

Exit codes of `spill run`: 0 every row succeeded; 3 the job finished with failed rows (their
lines carry "error"); 130 interrupted (Ctrl-C, `spill cancel`, `spill down`); 1 the job failed
or the group stopped answering; 2 a mistake in the command or its files (nothing ran).
"""

import json
import os
import re
import signal
import time

import typer

from spill import config
from spill.errors import SpillError
from spill.memory import describe_line, memory_args
from spill.streamer.shares import kv_setting

from . import rundir
from .first_use import make_demo
from .metrics_line import NOT_SERVED
from .preflight import check_run, local_model   # light: a refused command never imports ZeroMQ, numpy or MLX
from .ring import launched_hosts

EXIT_FAILED_ROWS, EXIT_INTERRUPTED = 3, 130
SUBMIT_TIMEOUT_S = 120   # the group answers once it has read the input; the estimate comes later (`estimating`)
RESUME = "resume with: spill run --resume {}"


def _listen(listen: str | None) -> str | None:
    """A bare port means tcp://127.0.0.1:PORT; anything else must be a tcp:// or ipc:// address."""
    if listen is None:
        return None
    if listen.isdigit() and 0 < int(listen) < 65536:
        return f"tcp://127.0.0.1:{listen}"
    if re.fullmatch(r"tcp://[\w.\-\[\]:*]+:\d{1,5}", listen) or re.fullmatch(r"ipc://.+", listen):
        return listen
    raise SpillError(f"--listen must be a port (5557) or an address such as tcp://127.0.0.1:5557, found {listen!r}")


def openblas_note() -> None:
    """Once per command, on Linux without OpenBLAS: matmuls run 20-40x slower, and how to fix it."""
    from spill.platform import openblas_missing
    if openblas_missing():
        typer.echo("spill: OpenBLAS was not found, so matrix products on this CPU run 20-40x slower; "
                   "install it with `sudo apt-get install libopenblas0-pthread`", err=True)


def _connect(listen: str | None, memory: dict):
    """A client of the running group, and the group process when this command had to start one."""
    from .client import Client, GroupDead, endpoints, start_group
    eps = endpoints(_listen(listen))
    client = Client(eps)
    if _ping(client):
        return _watched(client), None
    group = start_group(eps, embedded=True, actor_args=memory)
    if group is not None:
        client.alive = lambda: group.poll() is None
        return client, group
    deadline = time.monotonic() + 60    # another group took the run directory meanwhile: join it
    while time.monotonic() < deadline:
        client = Client(endpoints())
        if client.ping():
            rec = rundir.record() or {}
            typer.echo(f"joined the running spill group (coordinator pid {rec.get('pid', '?')})")
            return _watched(client), None
        time.sleep(0.1)
    raise GroupDead(rundir.held_by_sentence())


def first_use(model: str | None, kv: tuple | None = None):
    """Around the wait for the job's estimate: a model not calibrated here is calibrated by the group first; say
    so. Otherwise a spinner on a terminal, and nothing piped."""
    import sys
    from contextlib import nullcontext
    from .first_use import calibrated, calibrating, local_folder, working
    folder = local_folder(model or "")
    if folder is not None and not calibrated(folder, kv):
        return calibrating(folder)
    return working("estimating: counting the rows' tokens", None) if sys.stderr.isatty() else nullcontext({})


def _watched(client):
    """A client of a group in this data home learns at once when its coordinator exits (the run lock is freed)."""
    if rundir.record() is not None:
        client.alive = lambda: rundir.record() is not None
    return client


def run_job(*, model, input, output, max_tokens, temperature, resume, new, quiet, listen, every=10.0,
            stream=False, memory: dict | None = None, kv: dict | None = None, speculate: int | None = None,
            draft: str | None = None, ranks: int | None = None, micro_batches: int | None = None) -> int:
    """`memory`: the checked --memory/--budget-fraction (memory_args: None where not given); `kv`: the checked
    --kv-bits/--kv-group-size (a resumed job keeps its own); `speculate`: --speculate's K (0: off; None: not given,
    a resumed job keeps its own); `ranks`: --ranks (None: the running group's, else one); `micro_batches`: the same
    for --micro-batches (None: the running group's, else one a rank)."""
    openblas_note()
    args, finished = check_run(model=model, input=input, output=output, max_tokens=max_tokens,
                               temperature=temperature, resume=resume, new=new)
    args["stream"] = bool(stream or config.stream() or args.get("stream"))   # SPILL_STREAM: --stream's default
    if kv and kv.get("kv_bits"):
        if resume and kv_setting(args) != kv_setting(kv):
            raise SpillError(f"job {resume} runs with the KV format it started with; leave --kv-bits and "
                             f"--kv-group-size out to continue it, or run its input as a new job with them")
        args.update(kv)
    if speculate is not None:
        if resume and speculate != (args.get("speculate") or 0):
            raise SpillError(f"job {resume} runs with the --speculate it started with; leave --speculate out to "
                             "continue it, or run its input as a new job with it")
        args["speculate"] = speculate
    if draft is not None:
        draft = local_model(draft)   # a folder as the user typed it, from here
        if resume and draft != args.get("draft"):
            raise SpillError(f"job {resume} runs with the --draft it started with; leave --draft out to continue it, "
                             "or run its input as a new job with it")
        args["draft"] = draft
    if finished is not None:
        c = finished.counts()
        typer.echo(f"job {finished.id} already ran this command: done, {c['succeeded']} succeeded, {c['failed']} "
                   f"failed; output {finished.output_path}. Add --new to run it again.")
        return 0
    memory = {k: v if v is not None else args.get(k) for k, v in (memory or memory_args()).items()}   # resumed: the job's
    if ranks:
        check_ranks(args.get("model"), ranks)
        memory["ranks"] = ranks   # the embedded group's pipeline, or what the running one must run
    if micro_batches is not None:
        memory["micro_batches"] = micro_batches
    args = {**args, **memory}
    from spill import messages as m
    from .client import GroupDead, leave_group
    from .jobstore import ask_to_stop
    from .live import follow
    client, group, job = None, None, None

    def second_press(*_):
        if job:
            ask_to_stop(job)         # the first press's request may not have reached a stalled group
        typer.echo("\nstopped at once; every row already written stays written"
                   + (f"; {RESUME.format(job)}" if job else ""))
        os._exit(EXIT_INTERRUPTED)   # an embedded group sees its owner go and stops the job itself

    presses = []

    def on_sigint(*_):               # counted here, so a second press can never land as a traceback
        presses.append(time.monotonic())
        if len(presses) == 1:
            raise KeyboardInterrupt
        second_press()
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        if args.get("model") == "demo":
            make_demo()
        client, group = _connect(listen, memory)
        info = client.request(m.SubmitJob(**args, client=str(os.getpid())), timeout_s=SUBMIT_TIMEOUT_S)
        job = info.job
        bad = info.invalid   # written as error lines at submit, so counted in done
        typer.echo(f"job {job}: {info.total} rows, "
                   + (f"{bad} invalid (an error line each in the output), " if bad else "")
                   + f"{info.done - bad} already done; output {info.output}")
        if info.warning:
            typer.echo(f"warning: {info.warning}")
        if group is not None and info.metrics.startswith(NOT_SERVED):   # the group started here
            typer.echo(f"warning: {info.metrics}", err=True)

        def status():
            for _ in range(30):   # a second at a time, so a dead embedded group is seen at once
                if group is not None and group.poll() is not None:
                    break
                try:
                    return client.request(m.Status(job, str(os.getpid())), timeout_s=1)
                except GroupDead:
                    continue
            raise GroupDead(f"the spill group stopped answering; {RESUME.format(job)}")
        kv = kv_setting(args)
        with first_use(args.get("model"), kv) as said:
            s = _estimated(status)
            if s.status == "failed":
                said["done"] = None   # not calibrated after all: the job's error says why
        for line in (s.advice, s.estimate_line):
            if line:
                typer.echo(line)
        return _summary(follow(status, quiet=quiet, every=every))
    except KeyboardInterrupt:
        if job is None:
            typer.echo("\nstopped before the job started")
            return EXIT_INTERRUPTED
        s = client.request(m.Interrupt(job), timeout_s=30)
        when = "while estimating" if s.was == "estimating" else "at a pass boundary"
        typer.echo(f"\nstopped {when}: {_known(s.done)}/{_known(s.total)} rows written; {RESUME.format(job)}")
        return EXIT_INTERRUPTED
    finally:
        if group is not None:
            leave_group(group, client)
        if client is not None:
            client.close()
        signal.signal(signal.SIGINT, previous)


def _known(value) -> str:
    return "?" if value is None else str(value)


def _estimated(status, poll_s: float = 0.25):
    """The job's status (m.JobStatus) once the group has made its estimate (or the job ended meanwhile)."""
    while (s := status()).status == "estimating":
        time.sleep(poll_s)
    return s


def _summary(s) -> int:
    """The job's last line(s) from its final m.JobStatus: what succeeded and failed, where the output is, and the
    exit code."""
    job, status = s.job, s.status
    counts = f"{s.done}/{s.total} rows, {s.succeeded} succeeded, {s.failed} failed"
    if status in ("interrupted", "cancelled"):
        typer.echo(f"job {job} {status}: {counts}; {RESUME.format(job)}")
        return EXIT_INTERRUPTED
    typer.echo(f"job {job} {status}: {counts}; output {s.output}")
    if status == "done" and s.summary:
        from .estimate_text import summary_lines
        typer.echo("\n".join(summary_lines(s.summary)))
    if status == "failed":
        typer.echo(f"spill: {s.error}", err=True)
        return 1
    if s.failed:
        typer.echo(f"{s.failed} row(s) failed: their lines in the output carry \"error\"; "
                   f"the first: {_first_error(s.output)}")
        return EXIT_FAILED_ROWS
    return 0


def _first_error(path) -> str:
    try:
        with open(path, "rb") as f:
            for raw in f:
                if b'"error"' in raw and isinstance((line := json.loads(raw)).get("error"), dict):
                    named = f"{line['custom_id']}: " if line.get("custom_id") is not None else ""
                    return named + str(line["error"].get("message"))
    except (OSError, ValueError):
        pass
    return "?"


def group_up(*, model, foreground, listen, memory: dict | None = None, group_args: dict | None = None) -> str:
    """`group_args`: the coordinator's own settings (`spill up`'s --allow-remote and --metrics-*)."""
    from .client import Client, endpoints, start_group
    eps = endpoints(_listen(listen))
    rec = rundir.record()
    if rec is not None or _ping(Client(eps)):
        if launched_hosts():   # mlx.launch's other ranks would wait on a rank 0 that never comes
            raise SpillError(f"{rundir.held_by_sentence()}; `spill down` it before mlx.launch starts a pipeline group")
        return rundir.held_by_sentence()
    if model:
        from .models import resolve
        folder = resolve(model)   # makes the demo model now rather than at the first job
        check_ranks(str(folder), len(launched_hosts() or []) or (memory or {}).get("ranks") or 1)
    if foreground:
        import subprocess
        import sys
        rundir.rotate_logs()
        args = {"endpoints": eps.as_dict(), "actor_args": memory or memory_args(), "group_args": group_args or {},
                "parent_fd": None}
        code = subprocess.run([sys.executable, "-m", "spill.coordinator.daemon", json.dumps(args)]).returncode
        if code == rundir.LOCKED_EXIT:   # lost a race to another `spill up`: a group is up, as below
            return rundir.held_by_sentence()
        return "spill group stopped"
    proc = start_group(eps, embedded=False, actor_args=memory or memory_args(), group_args=group_args)
    if proc is None:
        return rundir.held_by_sentence()
    up = (f"spill group up (coordinator pid {proc.pid}, control {eps.control}); `spill run`, `status`, "
          f"`cancel` and `down` find it through {rundir.run_dir() / 'group.json'}")
    from spill import messages as m
    client = Client(eps)
    metrics = client.request(m.Status()).metrics
    client.close()
    if metrics.startswith(NOT_SERVED):
        typer.echo(f"warning: {metrics}", err=True)
        return up
    return f"{up}\n{metrics}"


def check_ranks(model: str | None, ranks: int) -> None:
    """A pipeline of more ranks than a local model has layers is refused before any group starts (split's sentence)."""
    if ranks > 1 and model and os.path.isdir(model):
        from spill.stages.split import stage_shares
        from spill.streamer.plan import load_plan
        stage_shares(load_plan(model), ranks)


def _answering(client) -> int:
    """The group's coordinator pid, or 0 when no group holds the run directory; one that holds it but is
    slow to answer (reading a job's input) gets 10 s before that is an error."""
    pid = _ping(client)
    if pid or (held := rundir.record()) is None:
        return pid
    if pid := client.ping(timeout_s=10):
        return pid
    raise SpillError(f"the spill group (coordinator pid {held.get('pid', '?')}) did not answer in 10 s; try again "
                     f"in a moment, and if it stays silent stop it with kill {held.get('pid', 'PID')}")


def _ping(client) -> int:
    """client.ping(), but 0 at once where no group holds this data home and no process has bound the client's
    ipc socket: ZeroMQ would wait the ping's 0.5 s out for one to bind it."""
    control = client.eps.control
    if control.startswith("ipc://") and not os.path.exists(control[len("ipc://"):]) and rundir.record() is None:
        return 0
    return client.ping()


def group_down(listen) -> str:
    from spill import messages as m
    from .client import Client, endpoints
    client = Client(endpoints(_listen(listen)))
    if not _answering(client):
        return "no spill group is running"
    stopped = client.request(m.Down()).stopped
    deadline = time.monotonic() + 30
    while rundir.record() is not None and time.monotonic() < deadline:   # return once it is down
        time.sleep(0.1)
    lines = [f"job {j.job} ({j.was}, {j.done}/{j.total} rows written) is interrupted; "
             f"{RESUME.format(j.job)}" for j in stopped]
    return "\n".join(["spill group stopped" + ("" if stopped else "; no job was running or queued"), *lines])


def cancel_job(job: str, listen) -> str:
    """Stop a running or queued job; with no group up, mark an unfinished job cancelled."""
    from spill import messages as m
    from .client import Client, endpoints
    client = Client(endpoints(_listen(listen)))
    if _answering(client):
        s = client.request(m.Cancel(job))
        return f"job {job} cancelled ({s.was}, {s.done}/{s.total} rows written); {RESUME.format(job)}"
    from .jobstore import Job
    j = Job.open(job)
    if j.meta.get("status") in ("done", "failed", "cancelled"):
        raise SpillError(f"job {job} is {j.meta['status']}; there is nothing to cancel")
    j.set_status("cancelled")
    return f"job {job} cancelled ({len(j.done_ids())}/{j.meta.get('total')} rows written); {RESUME.format(job)}"


def group_status(job, listen) -> str:
    from spill import messages as m
    from .client import Client, endpoints
    from .live import progress_line
    openblas_note()
    client = Client(endpoints(_listen(listen)))
    if not _answering(client):
        if job:
            from .jobstore import Job
            j = Job.open(job)
            c = j.counts()
            return (f"no spill group is running; job {j.id} is {j.meta.get('status')}: {len(j.done_ids())}/"
                    f"{j.meta.get('total')} rows ({c['succeeded']} succeeded, {c['failed']} failed) in {j.output_path}")
        return "no spill group is running" + _recent_jobs()
    s = client.request(m.Status(job))
    procs = "  ".join(f"{role} pid {pid}" for role, pid in s.processes.items())
    procs += "".join(f"\n{line}" for line in s.stages)   # a pipeline group: a line a stage
    mem = "".join(f"\n{line}" for line in (describe_line(s.memory) if s.memory else "", s.metrics) if line)
    if not s.job:
        return f"group: {procs}\nno job running{mem}" + _recent_jobs()
    line = progress_line(s)   # an estimating job's line names its status itself
    state = "" if line.startswith(f"{s.status}: ") else f"{s.status}: "
    kv = f"; KV {s.kv}" if s.kv != "unquantized" else ""   # the default unsaid
    return f"group: {procs}\njob {s.job} {state}{line}{kv}{mem}" + _recent_jobs()


def _recent_jobs(n: int = 10) -> str:
    """The newest jobs in the data home, one line each: id, status, model, input -> output."""
    from .jobstore import jobs_dir, list_jobs
    lines = [f"  {m.get('id', '?')}  {m.get('status', '?'):<11}  {m.get('model', '?')}  {m.get('input', '?')}"
             f"  ->  {m.get('output') or jobs_dir() / m.get('id', '?') / 'output.jsonl'}"
             for m in list_jobs()[:n]]
    return ("\njobs (newest first):\n" + "\n".join(lines)) if lines else ""
