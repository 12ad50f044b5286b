"""What every actor process does around its loop: logging, a parent watch, a ready handshake,
fault-injection knobs for tests, and one place that catches a crash and logs it."""

import contextlib
import json
import os
import sys
import threading
import traceback
from logging.handlers import RotatingFileHandler
from pathlib import Path

import structlog

from . import config
from .errors import RankLost, SpillError
from .platform import use_device, without_torch
from .wire import Endpoints


def parent_watch(fd: int, then=lambda: os._exit(0)) -> None:
    """Exit (or `then()`) when the parent dies: its end of our pipe closes and a read returns EOF (portable)."""
    def watch():
        while os.read(fd, 1):
            pass
        then()
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class RotatingLines:
    """Lines appended to a file that rotates by size like logging's RotatingFileHandler (<name>.1 is
    the newest old file), whose rollover it uses; it counts bytes instead of a seek per line."""

    def __init__(self, path: Path, max_bytes: int, backups: int):
        self.handler = RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self.max_bytes, self.size = max_bytes, self.handler.stream.tell()
        self.lock = threading.Lock()

    def write(self, line: str) -> None:
        data = line + "\n"
        n = len(data.encode())
        with self.lock:
            if self.size and self.size + n > self.max_bytes:
                self.handler.doRollover()
                self.size = 0
            self.handler.stream.write(data)
            self.handler.stream.flush()
            self.size += n


def setup_logging(role: str) -> structlog.BoundLogger:
    """The logging of every spill process: JSON lines in $SPILL_HOME/run/logs/<role>.log, rotated by
    size (SPILL_LOG_MAX_BYTES, SPILL_LOG_BACKUPS), from SPILL_LOG_LEVEL up; key=value on stderr, where warnings and errors
    only go unless it is a terminal. Every line carries actor and pid, and job and pass_index once
    the process has bound them (structlog's contextvars: `bind_context`)."""
    logs = config.home() / "run" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    file = RotatingLines(logs / f"{role}.log", config.log_max_bytes(), config.log_backups())
    console = structlog.dev.ConsoleRenderer(colors=False)
    as_json = structlog.processors.JSONRenderer()
    terminal, pid = sys.stderr.isatty(), os.getpid()

    def process(logger, name, event):
        event.setdefault("actor", role)
        event.setdefault("pid", pid)
        return event

    def both(logger, name, event):
        file.write(as_json(logger, name, dict(event)))
        if terminal or event.get("level") in ("warning", "error", "critical"):
            return console(logger, name, event)
        raise structlog.DropEvent

    structlog.configure(processors=[structlog.contextvars.merge_contextvars, process,
                                    structlog.processors.add_log_level,
                                    structlog.processors.TimeStamper(fmt="iso"), both],
                        wrapper_class=structlog.make_filtering_bound_logger(config.log_level()),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    return structlog.get_logger()


def bind_context(msg) -> None:
    """Job id and pass index for every later log line of this process, from a message it handles."""
    from .messages import Pass, Reset, Tokens
    if isinstance(msg, Reset):
        structlog.contextvars.unbind_contextvars("job", "pass_index")
        if msg.job:
            structlog.contextvars.bind_contextvars(job=msg.job)
    elif isinstance(msg, (Pass, Tokens)):
        structlog.contextvars.bind_contextvars(pass_index=msg.index if isinstance(msg, Pass) else msg.pass_index)


class Fault:
    """SPILL_TEST_CRASH_<ROLE>="event:n" kills this process (like kill -9) at the n-th event; "event:n:wedge" blocks its
    loop there for ever instead (a deadlock: the heartbeat thread still beats, the loop's progress stops)."""

    def __init__(self, role: str):
        spec = config.crash_knob(role).split(":")
        self.event, self.at, self.wedge = (spec[0], int(spec[1]), spec[2:] == ["wedge"]) if spec[0] else ("", 0, False)
        self.seen = 0

    def tick(self, event: str) -> None:
        if event == self.event:
            self.seen += 1
            if self.seen == self.at:
                threading.Event().wait() if self.wedge else os._exit(137)


def run_actor(role: str, main) -> None:
    """Entry of an actor process: `python -m spill.<actor>.process '<json args>'`."""
    without_torch()
    args = json.loads(sys.argv[1])
    use_device(args.get("device"))   # the coordinator's (an actor's argument); the coordinator learns its own
    if args.get("parent_fd") is not None:
        parent_watch(args["parent_fd"])
    log = setup_logging(role)
    try:
        main(Endpoints(**args["endpoints"]), args, log)
    except KeyboardInterrupt:
        pass
    except RankLost as err:   # the pipeline's end, not the user's: the supervisor starts the streamer again alone
        log.warning("pipeline rank lost", error=str(err))
        with contextlib.suppress(OSError):
            lost_file(os.getpid()).write_text(json.dumps({"rank": err.rank, "why": str(err)}))
        os._exit(1)   # at once: the relay's thread may be stuck in a receive that never returns
    except BaseException as err:  # noqa: BLE001 - logged, then the supervisor sees the exit code
        log.error("crashed", traceback=traceback.format_exc())
        final = isinstance(err, SpillError)   # a fact about the user's files or input: no restart changes it
        with contextlib.suppress(OSError):   # unwritten, it is a crash of no named cause
            failure_file(os.getpid(), final).write_text(str(err) if final else first_line(err))
        sys.exit(1)


def failure_file(pid: int, final: bool = True) -> Path:
    """Where an actor that stopped on an error leaves it for the supervisor: a SpillError's sentence (final,
    supervisor.why), else the exception's first line (supervisor.cause)."""
    return config.home() / "run" / f"{'failed' if final else 'crashed'}-{pid}.txt"


def lost_file(pid: int) -> Path:
    """Where a pipeline's streamer that lost a rank leaves the rank and why (JSON) for the supervisor."""
    return config.home() / "run" / f"lost-{pid}.json"


def first_line(err: BaseException) -> str:
    """`Type: message` on one line, at most 300 characters, without a closing full stop."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}{': ' + text[0] if text else ''}"[:300].rstrip(".")


class EpochGate:
    """Orders row messages around RESET: drops those of an older epoch, holds those of a newer
    one until its RESET arrives (senders differ, so a row can overtake the reset that precedes it)."""

    def __init__(self):
        self.epoch = -1
        self._early: list = []

    def __call__(self, msg) -> list:
        """The messages to handle now, given one that just arrived."""
        from .messages import Reset
        if isinstance(msg, Reset):
            self.epoch = msg.epoch
            ready = [x for x in self._early if x.epoch == msg.epoch]
            self._early = [x for x in self._early if x.epoch > msg.epoch]
            return [msg, *ready]
        epoch = getattr(msg, "epoch", None)
        if epoch is None or epoch == self.epoch:
            return [msg]
        if epoch > self.epoch:
            self._early.append(msg)
        return []


HEARTBEAT_S = 1.0


class Progress:
    """What the loop's beats say: batches handled (inbox advances it), and whether it is working now."""
    def __init__(self):
        self.batches, self.busy = 0, True


def heartbeat(endpoints: Endpoints, role: str, progress: Progress) -> None:
    """Tell the coordinator every second, from a thread, that this process is scheduled and how far its loop
    has come: a stopped (SIGSTOP) process does not beat, a wedged loop beats without progress; both are restarted."""
    import time

    import zmq

    from .messages import Heartbeat, encode

    def beat():
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoints.coordinator)
        while True:
            frame = encode(Heartbeat(role, os.getpid(), progress.batches, progress.busy))
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:   # the coordinator is not reading: it will see us when it does
                pass
            time.sleep(HEARTBEAT_S)
    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def inbox(box, role: str, log, busy=lambda: False, wait=lambda: None, ready: dict | None = None):
    """Say READY (with the fields `ready` adds), then yield each batch of arrived messages (epoch-gated) until
    SHUTDOWN. While `busy()` it does not block: a loop with work to do only drains what came; else it waits
    `wait()` seconds at most (None: until a message), and may yield an empty batch."""
    from .messages import Ready, Shutdown
    progress = Progress()
    heartbeat(box.endpoints, role, progress)
    from .memory import process_memory
    now = process_memory()
    box.send("coordinator", Ready(role, os.getpid(), now.rss, now.file, **(ready or {})))
    log.info("ready")
    gate = EpochGate()
    while True:
        progress.batches += 1   # the loop came back for more: it is not wedged
        if busy():
            arrived = box.drain()
        else:
            progress.busy = False
            first = box.recv(None if (w := wait()) is None else int(w * 1000) + 1)
            arrived, progress.busy = ([] if first is None else [first]) + box.drain(), True
        if any(isinstance(msg, Shutdown) for msg in arrived):
            return
        batch = [msg for a in arrived for msg in gate(a)]
        for msg in batch:
            bind_context(msg)
        yield batch
