"""The coordinator's watch on its actors: one that stopped beating, or whose loop is stuck, is killed; one that
died is restarted (a new epoch: every unfinished row of the running job is computed again once it is READY),
and the running job fails only of an error no restart fixes or of too many crashes. A pipeline's streamer that
lost a rank is not a crash: the streamer starts again alone and the job goes on, told why."""

import time

from spill import config

MAX_CRASHES = 3   # restarts of one actor during one job before the job fails


def check_actors(group) -> None:
    sup, log, current = group.sup, group.log, group.current
    last = current.last_pass if current else None   # busy beats, the loop's count still: a deadlock
    wedge, beat = config.wedge_timeout(last.seconds if last else 0.0), config.liveness_timeout()   # no beat: stopped
    stuck = {role: wedge for role in sup.wedged(wedge)} | {role: beat for role in sup.hung(beat)}
    for role, deadline in stuck.items():
        log.warning("actor hung; killing it", role=role, deadline_s=deadline)
        sup.kill(role)
    for role, code in sup.dead():
        if lost := sup.lost(role):   # the pipeline's end: rank 0 goes on alone, the rows are computed again
            log.warning("pipeline rank lost; the streamer starts again alone", role=role, error=lost)
            if group.current is not None:
                group.current.notes.append(lost)
        else:
            _crashed(group, role, code)
        sup.restart(role)
        if not group.waiting:
            group.waiting_since = time.monotonic()
        group.waiting.add(role)
        group.epoch += 1    # whatever the group holds now is stale
    quiet = time.monotonic() - max(sup.active_at, group.stirred)   # rows out, every actor idle: lost on the way
    if group.current and group.current.in_flight and not group.waiting and quiet > config.stall_timeout():
        log.warning("rows outstanding while every actor is idle; submitting them again", quiet_s=round(quiet))
        group._restart_rows()


def _crashed(group, role: str, code: int) -> None:
    why = group.sup.why(role)   # an error no restart fixes (a corrupt shard): the job fails with it at once
    cause = group.sup.why(role, final=False)   # a crash's exception, named if the job fails of crashes
    group.log.warning("actor died; restarting", role=role, exit_code=code, error=why or cause or None)
    group.crashes[role] = group.crashes.get(role, 0) + 1
    if group.current is not None and (why or group.crashes[role] > MAX_CRASHES):
        group.fail(why or f"the {role} crashed {group.crashes[role]} times during this job"
                   f"{f' (the last time: {cause})' if cause else ''}; "
                   f"see {config.home() / 'run' / 'logs' / (role + '.log')}")
