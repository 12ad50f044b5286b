"""What `spill run`, `up`, `down` and `status` do, as a client of the group."""

import signal
from pathlib import Path

import typer

from spill.errors import SpillError
from spill.memory import describe_line, memory_args

from .client import Client, GroupDead, endpoints, start_group
from .live import follow, progress_line


def _listen(listen: str | None) -> str | None:
    """A bare port means 127.0.0.1:PORT."""
    if listen and listen.isdigit():
        return f"tcp://127.0.0.1:{listen}"
    return listen


def run_job(*, model, input, output, max_tokens, temperature, resume, new, quiet, listen,
            memory: dict | None = None, explicit: bool = False) -> int:
    """`memory`: the checked --memory/--budget-fraction; `explicit`: --budget-fraction was given."""
    eps = endpoints(_listen(listen))
    client, group = Client(eps), None
    memory = memory or memory_args()
    if not client.ping():
        group = start_group(eps, embedded=True, actor_args=memory)
    job = None
    try:
        args = {"model": model, "input": str(Path(input).resolve()) if input else None,
                "output": str(Path(output).resolve()) if output else None,
                "max_tokens": max_tokens, "temperature": temperature, "resume": resume, "new": new,
                "memory": memory["memory"], "budget_fraction": memory["budget_fraction"] if explicit else None}
        info = client.request("submit", timeout_s=600, **args)
        job = info["job"]
        typer.echo(f"job {job}: {info['total']} rows, {info['done']} already done; output {info['output']}")
        def status():
            for _ in range(30):   # a second at a time, so a dead embedded group is seen at once
                if group is not None and group.poll() is not None:
                    break
                try:
                    return client.request("status", timeout_s=1, job=job)
                except GroupDead:
                    continue
            raise GroupDead(f"the spill group stopped answering; resume with: spill run --resume {job}")
        final = follow(status, quiet=quiet)
        typer.echo(f"job {job} {final['status']}: {final.get('done')}/{final.get('total')} rows in {final.get('output')}")
        if final.get("error"):
            typer.echo(f"spill: {final['error']}", err=True)
        return 0 if final["status"] == "done" else 1
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C must not tear the stop
        if job is not None:
            s = client.request("interrupt", job=job)
            typer.echo(f"\nstopped at a pass boundary: {s.get('done', '?')}/{s.get('total', '?')} rows written; "
                       f"resume with: spill run --resume {job}")
        return 130
    finally:
        if group is not None:
            try:
                if group.poll() is None:
                    client.request("down", timeout_s=30)
            except GroupDead:
                group.kill()
            group.wait()
        client.close()


def group_up(*, model, foreground, listen, memory: dict | None = None) -> str:
    eps = endpoints(_listen(listen))
    if Client(eps).ping():
        return "spill group already running"
    if model:
        from .models import resolve
        resolve(model)   # makes the demo model now rather than at the first job
    if foreground:
        import json
        import subprocess
        import sys
        args = {"endpoints": eps.as_dict(), "actor_args": memory or memory_args(), "parent_fd": None}
        subprocess.run([sys.executable, "-m", "spill.coordinator.daemon", json.dumps(args)])
        return "spill group stopped"
    proc = start_group(eps, embedded=False, actor_args=memory or memory_args())
    return f"spill group up (coordinator pid {proc.pid}); submit with `spill run MODEL INPUT.jsonl`"


def group_down(listen) -> str:
    client = Client(endpoints(_listen(listen)))
    if not client.ping():
        return "no spill group is running"
    client.request("down")
    return "spill group stopped"


def group_status(job, listen) -> str:
    client = Client(endpoints(_listen(listen)))
    if not client.ping():
        if job:
            from .jobstore import Job
            j = Job.open(job)
            return f"no spill group is running; job {j.id} is {j.meta.get('status')}: {len(j.done_ids())}/{j.meta.get('total')} rows"
        return "no spill group is running" + _recent_jobs()
    s = client.request("status", job=job)
    procs = "  ".join(f"{role} pid {pid}" for role, pid in s.get("processes", {}).items())
    mem = f"\n{describe_line(s['memory'])}" if s.get("memory") else ""
    if not s.get("job"):
        return f"group: {procs}\nno job running{mem}" + _recent_jobs()
    return f"group: {procs}\njob {s['job']} {s.get('status')}: {progress_line(s)}{mem}" + _recent_jobs()


def _recent_jobs(n: int = 10) -> str:
    """The newest jobs in the data home, one line each."""
    from .jobstore import list_jobs
    lines = [f"  {m.get('id', '?')}  {m.get('status', '?'):<11}  {m.get('model', '?')}  {m.get('input', '?')}"
             for m in list_jobs()[:n]]
    return ("\njobs (newest first):\n" + "\n".join(lines)) if lines else ""
