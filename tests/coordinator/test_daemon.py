"""The coordinator's Group driven by hand: a fake mailbox and supervisor, real job store (issue 8)."""

import errno
import json
import os
import threading
import time

import pytest
import structlog

from spill import config
from spill import messages as m
from spill.coordinator import daemon, estimating, first_use
from spill.coordinator.daemon import Group
from spill.coordinator.ring import Ring
from spill.coordinator.supervisor import ACTORS, Supervisor

from .group_util import read_output


class Box:
    def __init__(self):
        self.sent = []

    def send(self, peer, msg):
        self.sent.append((peer, msg))


class Sup:
    def __init__(self):
        self.killed, self.beats, self.stuck, self.restarted = [], [], [], []
        self.args = {}   # the actors' args (memory, budget_fraction), as the Supervisor holds them
        self.active_at = 0.0   # when an actor last worked (Supervisor.beat)
        self.ring = Ring()     # a group of one rank: no followers' memory

    layout = Supervisor.layout   # the estimate's view of the ranks, from the args and the ring above

    def dead(self):
        return [(r, -9) for r in self.killed if r not in self.restarted]

    def hung(self, deadline_s):
        return list(self.stuck)

    def wedged(self, deadline_s):
        return []

    def kill(self, role):
        self.killed.append(role)
        self.stuck.remove(role)

    def restart(self, role):
        self.restarted.append(role)

    def beat(self, role, pid, progress=0, busy=True):
        self.beats.append(role)

    def why(self, role, final=True):
        return ""

    def lost(self, role):
        return ""

    def stages(self, folder, by_compute=False, replicas=False, own=None):
        self.split = (folder, by_compute)   # what `spill status` was asked to show
        return []

    def pids(self):
        return {}


@pytest.fixture(autouse=True)
def no_estimate(monkeypatch):
    """The jobs here run on a model that is only a config.json: each goes on without an estimate, at once."""
    monkeypatch.setattr(estimating, "work", lambda ask, cancelled=None: {"estimate": None})
    monkeypatch.setattr(first_use, "calibrated", lambda folder, kv=None: True)   # no probe waits for an idle group


def settle(g: Group) -> None:
    """The loop's turns until every job's estimate is made, and the next job started."""
    deadline = time.monotonic() + 30
    while g.estimates.jobs:
        assert time.monotonic() < deadline, "an estimate never ended"
        g.check_estimates()
        time.sleep(0.01)
    g.next_job()


def group() -> Group:
    g = Group(Box(), Sup(), structlog.get_logger())
    for role in ACTORS:
        g.on_actor(m.Ready(role, 1))
    return g


def submit(g: Group, tmp_path, name: str, rows: int = 2, wait: bool = True, model=None) -> m.Queued:
    """Submit a job of `rows` rows on `model` (default: `tmp_path`, a config.json); `wait`: until it is estimated."""
    inp = tmp_path / f"{name}.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"{name}{i}", "prompt": f"{name} {i}"}) + "\n" for i in range(rows)))
    model = model or tmp_path
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"model_type": "llama"}')   # submit classifies the model first
    reply = g.handle(m.SubmitJob(str(model), str(inp), str(tmp_path / f"{name}.out.jsonl")))
    if wait:
        settle(g)
    return reply


def done(epoch: int, rows: list[int], text: str, job: str = "") -> m.Done:
    stamp = {"job": job} if job else {}
    return m.Done(epoch, rows, [text] * len(rows), ["length"] * len(rows), [1] * len(rows), [1] * len(rows), **stamp)


def test_a_result_of_the_previous_job_is_not_written_into_the_next(tmp_path):
    g = group()
    a = submit(g, tmp_path, "a")
    b = submit(g, tmp_path, "b")
    epoch_a = g.epoch
    g.handle(m.Interrupt(a.job))
    g.next_job()                                       # b starts in the same loop turn
    assert g.current.job.id == b.job
    g.on_actor(done(epoch_a, [0], "text of a0"))        # late: the tokenizer finished it before the reset
    assert read_output(tmp_path / "b.out.jsonl") == {}
    g.on_actor(done(g.epoch, [1], "text of a1", job=a.job))   # stamped with the other job
    assert read_output(tmp_path / "b.out.jsonl") == {}
    g.on_actor(done(g.epoch, [0, 1], "text of b"))
    out = read_output(tmp_path / "b.out.jsonl")
    assert {cid: r["response"]["body"]["choices"][0]["text"] for cid, r in out.items()} == \
        {"b0": "text of b", "b1": "text of b"}


def test_an_unknown_request_and_a_crashing_request_get_replies(tmp_path, monkeypatch):
    g = group()
    reply = g.handle(m.Ready("x", 1))
    assert reply.error == ("unknown request Ready; this group answers ping, submit, status, interrupt, cancel, down "
                           "(is the client the same spill version as the group?)")
    monkeypatch.setattr(daemon, "prepare", lambda *args: 1 / 0)   # a bug on the submit's path
    reply = g.handle(m.SubmitJob(str(tmp_path), "in.jsonl"))
    assert isinstance(reply, m.Refused) and reply.error.startswith("submit failed (ZeroDivisionError")
    assert g.handle(m.Ping()) == m.Pong(os.getpid())


def test_each_request_type_is_answered_by_its_own_handler_with_its_reply_type(tmp_path):
    g = group()
    a, b = submit(g, tmp_path, "a"), submit(g, tmp_path, "b")
    assert isinstance(a, m.Queued) and a.status == "estimating"   # the reply does not wait for the estimate
    asked = [m.Ping(), m.Status(a.job), m.Interrupt(a.job), m.Cancel(b.job), m.Down()]
    assert {type(req) for req in asked} | {m.SubmitJob} == set(m.REQUESTS)
    for req in asked:
        assert type(g.handle(req)) is m.REPLIES[type(req)], req
    assert g.handle(m.Status(b.job)) == m.JobStatus(**{**g._status(m.Status(b.job)), "memory": g.memory,
                                                        "metrics": g.metrics})
    assert isinstance(g.handle(m.Cancel(b.job)), m.Refused)   # cancelled already: one sentence, no traceback


def test_an_output_that_cannot_be_opened_is_an_error_reply_not_a_dead_group(tmp_path):
    g = group()
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "prompt": "x"}\n')
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    reply = g.handle(m.SubmitJob(str(tmp_path), str(inp), "/proc/x.jsonl"))
    assert isinstance(reply, m.Refused)
    assert reply.error.startswith("cannot create -o /proc/x.jsonl (") and "choose a path in a folder you can write" in reply.error
    assert submit(g, tmp_path, "ok").job


def test_a_failed_write_fails_that_job_and_the_next_one_runs(tmp_path, monkeypatch):
    g = group()
    a = submit(g, tmp_path, "a")
    b = submit(g, tmp_path, "b")
    g.on_actor(done(g.epoch, [0], "first"))
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "write", full)
    g.on_actor(done(g.epoch, [1], "second"))
    monkeypatch.setattr(os, "write", real_write)
    status = g.status(m.Status(a.job))
    assert status.status == "failed"
    assert status.error == (f"no space left to write {tmp_path / 'a.out.jsonl'}; free some space and run the "
                               f"same command again to continue job {a.job}")
    assert list(read_output(tmp_path / "a.out.jsonl")) == ["a0"]      # valid, and resumable from a1
    g.next_job()
    assert g.current.job.id == b.job
    g.on_actor(done(g.epoch, [0, 1], "b"))
    assert g.status(m.Status(b.job)).status == "done"


def test_a_bug_while_handling_an_actor_message_fails_the_job_not_the_group(tmp_path, monkeypatch):
    g = group()
    a = submit(g, tmp_path, "a")
    monkeypatch.setattr(g.current, "on_progress", lambda msg: 1 / 0)
    g.on_actor(m.Progress(g.epoch, [0], [1], ["x"]))
    s = g.status(m.Status(a.job))
    assert s.status == "failed" and s.error.startswith("the coordinator could not handle a Progress message "
                                                             "(ZeroDivisionError: division by zero)")


def test_a_hung_actor_is_killed_and_restarted(tmp_path):
    g = group()
    submit(g, tmp_path, "a")
    g.sup.stuck.append("streamer")
    g.check_actors()
    assert g.sup.killed == ["streamer"] and g.sup.restarted == ["streamer"] and "streamer" in g.waiting
    g.on_actor(m.Heartbeat("tokenizer", 1))
    assert "tokenizer" in g.sup.beats


def test_an_actor_that_keeps_crashing_fails_the_job_naming_its_last_error(tmp_path, monkeypatch):
    """Every restarted streamer fails to allocate its first buffer: the job fails with that error, not only a count."""
    g = group()
    a = submit(g, tmp_path, "a")
    monkeypatch.setattr(g.sup, "dead", lambda: [("streamer", 1)])
    monkeypatch.setattr(g.sup, "why", lambda role, final=True: "" if final else "RuntimeError: [malloc] Unable to allocate")
    for _ in range(4):
        g.check_actors()
    assert g.status(m.Status(a.job)).error == (
        "the streamer crashed 4 times during this job (the last time: RuntimeError: [malloc] Unable to allocate); "
        f"see {config.home() / 'run' / 'logs' / 'streamer.log'}")


def test_the_control_socket_answers_garbage_and_refuses_a_wrong_token(tmp_path):
    from spill.coordinator.control import answer
    g, log = group(), structlog.get_logger()
    assert answer(g, b"\x99garbage", "", "ipc://x", log).error.startswith("not a spill request (unknown message kind")
    assert answer(g, m.encode(m.Ready("x", 1)), "", "ipc://x", log).error.startswith("unknown request Ready;")
    refused = answer(g, m.encode(m.Ping("guess")), "secret", "tcp://127.0.0.1:5557", log)
    assert isinstance(refused, m.Refused) and "wrong or missing control token" in refused.error
    assert isinstance(answer(g, m.encode(m.Ping("secret")), "secret", "tcp://127.0.0.1:5557", log), m.Pong)


def test_a_users_status_does_not_keep_a_killed_clients_queued_job_alive(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILL_CLIENT_TIMEOUT", "0.2")
    g = group()
    submit(g, tmp_path, "a")
    b = submit(g, tmp_path, "b")
    g.clients[b.job] = ("4242", g.clients[b.job][1])   # b's `spill run` (pid 4242) is then killed
    g.clients[g.current.job.id] = ("4241", g.clients[g.current.job.id][1])
    for _ in range(3):
        time.sleep(0.1)
        g.handle(m.Status(b.job))      # someone else's `spill status JOB`
        g.handle(m.Status(g.current.job.id, "4241"))   # a's client follows
    g.check_clients()
    assert [run.job.id for run in g.runs()] == [g.current.job.id]   # b left the queue; a still runs
    assert g.handle(m.Status(b.job)).status == "interrupted"


def test_the_streamers_resident_memory_at_ready_travels_in_every_reset(tmp_path):
    g = Group(Box(), Sup(), structlog.get_logger())
    for role in ACTORS:
        g.on_actor(m.Ready(role, 1, rss=(77 if role == "streamer" else 5) * 2**20))
    submit(g, tmp_path, "a")
    resets = [msg for _, msg in g.box.sent if isinstance(msg, m.Reset)]
    assert resets and {msg.runtime for msg in resets} == {77 * 2**20}


def test_admissions_price_of_the_group_reaches_the_running_jobs_estimate(tmp_path, monkeypatch):
    g = group()
    submit(g, tmp_path, "a")

    class Estimate:
        priced_at = []

        def priced(self, others):
            self.priced_at.append(others)
    g.current.estimate = Estimate()
    g.on_actor(m.Budget(g.epoch, 1, 2**30, 2**29, 2**29, 2**29, 300 * 2**20, 0, 0, job=g.current.job.id))
    g.on_actor(m.Budget(g.epoch, 2, 2**30, 2**29, 2**29, 2**29, 200 * 2**20, 0, 0, job="another job"))
    assert Estimate.priced_at == [300 * 2**20]


def test_a_job_starts_once_its_estimate_is_made_and_one_that_cannot_be_made_fails_that_job_alone(tmp_path, monkeypatch):
    made = threading.Event()

    def slow(ask, cancelled=None):
        made.wait(30)
        return {"error": f"model {ask['folder']}: cannot be read"} if "bad" in ask["input"] else {"estimate": None}
    monkeypatch.setattr(estimating, "work", slow)
    g = group()
    bad, ok = submit(g, tmp_path, "bad", wait=False), submit(g, tmp_path, "ok", wait=False)
    assert bad.status == ok.status == "estimating"   # the reply did not wait for the estimate
    for _ in range(3):
        g.check_estimates()
        g.next_job()
    assert g.current is None and g.status(m.Status(bad.job)).estimating == "counting the rows' tokens"
    assert g.status(m.Status(ok.job)).estimating == "waiting for the estimate of the job ahead"
    made.set()
    settle(g)
    assert g.status(m.Status(bad.job)).error == f"model {tmp_path}: cannot be read"
    assert g.status(m.Status(bad.job)).status == "failed" and g.current.job.id == ok.job


def test_a_job_whose_estimate_died_runs_without_one_and_its_client_is_told(tmp_path, monkeypatch):
    lost = "no estimate: its process was killed (signal 9; out of memory?); the job runs without one"
    monkeypatch.setattr(estimating, "work", lambda ask, cancelled=None: {"estimate": None, "lost": lost})
    a = submit(g := group(), tmp_path, "a")
    s = g.status(m.Status(a.job))
    assert s.status == "running" and g.current.job.id == a.job and s.notes == [lost]


def test_a_first_use_probe_waits_until_no_job_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(first_use, "calibrated", lambda folder, kv=None: folder.name != "new")
    g = group()
    a = submit(g, tmp_path, "a")
    new = submit(g, tmp_path, "n", wait=False, model=tmp_path / "new")
    for _ in range(3):
        g.check_estimates()
        time.sleep(0.01)
    assert g.status(m.Status(new.job)).estimating == "the model is calibrated once no job runs (first use)"
    g.on_actor(done(g.epoch, [0, 1], "text of a"))
    assert g.status(m.Status(a.job)).status == "done"
    settle(g)
    assert g.current.job.id == new.job


def test_status_shows_the_split_the_stages_keep_once_their_job_ended(tmp_path, monkeypatch):
    """A resident pipeline's job split its layers by compute; the stages keep that split after it, and so does
    `spill status` (it showed the split by bytes once no job ran)."""
    monkeypatch.setattr(daemon.JobRun, "by_compute", property(lambda run: True))
    a = submit(g := group(), tmp_path, "a")
    g.status(m.Status(a.job))
    assert g.sup.split == (str(tmp_path), True)
    g.on_actor(done(g.epoch, [0, 1], "text of a"))
    assert g.current is None and g.status(m.Status(a.job)).status == "done"
    assert g.sup.split == (str(tmp_path), True)
