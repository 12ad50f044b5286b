"""The coordinator's watch on its clients: each job's `spill run` asks for its status while it follows the job;
a job whose client has gone stops, and an embedded group whose owner has gone stops once idle."""

import time

from spill import config


def check_clients(group) -> None:
    """A queued job whose client is gone leaves the queue; the owner gone, its jobs stop and the group too once idle."""
    now = time.monotonic()
    live = {run.job.id for run in group.runs()}
    owner_gone = group.owner_gone.is_set() and group.owner
    for job, (client, seen) in list(group.clients.items()):
        if job not in live and ((owner_gone and client == group.owner) or now - seen > config.client_timeout()):
            del group.clients[job]    # ended, and its client never came back to see it
    for run in group.runs():
        client, seen = group.clients.get(run.job.id, ("", now))
        asked = run.job.stop_asked()   # a second Ctrl-C: the file its client wrote before leaving
        if asked or (owner_gone and client == group.owner) or \
                (run is not group.current and now - seen > config.client_timeout()):
            group.log.warning("stop asked by a second Ctrl-C" if asked else "client gone; stopping its job", job=run.job.id)
            group.stop_job(run, "interrupted")
    if owner_gone and not group.runs() and group.stop_at is None:
        group.stop_at = now
