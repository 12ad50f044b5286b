"""The crash-safe job store: $SPILL_HOME/jobs/<id>/ holds job.json, output.jsonl (unless -o names the file) and lock.

A row is done once its output line is fsynced; job.json is replaced atomically (temp, fsync, rename); on open a
torn tail of the output (power cut mid-write) is cut away, so a re-run continues exactly where the file ends.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import threading
from datetime import datetime, timezone
from pathlib import Path

from spill import config
from spill.coordinator.batch_output import encode
from spill.errors import SpillError
from spill.files import fsync as _fsync, fsync_dir as _fsync_dir, replaced

STATUSES = ("estimating", "queued", "running", "interrupted", "cancelled", "done", "failed")
LIVE = ("estimating", "queued", "running")   # one whose lock nobody holds lost its coordinator: interrupted
# job.json's params, beside max_tokens and temperature
SETTINGS = ("memory", "budget_fraction", "stream", "kv_bits", "kv_group_size", "speculate", "draft")
NEW_JOB_HINT = "start a new job with `spill run --new`"   # the CLI owns this flag; keep the two in step


STOP_ASKED = "interrupt"   # a file in the job's folder: its `spill run` left on a second Ctrl-C, maybe unheard


def ask_to_stop(job_id: str) -> None:
    """A second Ctrl-C: ask the group by file, which a stalled or busy group still reads when it wakes."""
    with contextlib.suppress(OSError):
        (jobs_dir() / job_id / STOP_ASKED).touch()


def jobs_dir() -> Path:
    return config.home() / "jobs"


def list_jobs() -> list[dict]:
    """The job.json of every job, newest first (ids sort by creation time)."""
    metas = (_read_meta(p) for p in sorted(jobs_dir().glob("*/job.json"), reverse=True))
    return [_true_status(m) for m in metas if m is not None]


def _true_status(meta: dict) -> dict:
    """A job left running or queued by a coordinator that died is interrupted (it took the lock, now released)."""
    lock = jobs_dir() / meta["id"] / "lock"
    if meta.get("status") in LIVE and lock.exists() and not lock_held(lock):
        meta["status"] = "interrupted"
    return meta


class Job:
    """One job: its directory, its job.json (meta) and the custom_ids its output already holds."""

    def __init__(self, dir: Path, meta: dict):
        self.id, self.dir, self.meta = dir.name, dir, meta
        self.repaired_bytes = 0              # bytes of torn tail cut from the output when this job was loaded
        self._done: set[str] = set()         # custom_ids in the output
        self._anon: set[str] = set()         # error messages of lines without a custom_id ("line 7: ...")
        self._counts = {"succeeded": 0, "failed": 0}
        self._mutex = threading.Lock()
        self._lock_fd: int | None = None
        self._load_output()

    @property
    def output_path(self) -> Path:
        out = self.meta.get("output")
        return Path(out) if out else self.dir / "output.jsonl"

    @classmethod
    def create(cls, input_path: Path, model: str, params: dict, output_path: Path | None = None) -> "Job":
        input_path = Path(input_path).resolve()
        digest = _sha256(input_path)
        out = Path(output_path).resolve() if output_path is not None else None
        if out is not None:
            check_output_free(out)
            _claim_output(out)
        root = jobs_dir()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        while True:                          # two jobs in the same second get different hex
            job_id = datetime.now(timezone.utc).strftime("%y%m%d-%H%M%S-") + secrets.token_hex(3)
            with contextlib.suppress(FileExistsError):
                (root / job_id).mkdir(mode=0o700)
                break
        _fsync_dir(root)
        now = _now()
        meta = {"id": job_id, "input": str(input_path), "input_sha256": digest, "model": model,
                "params": dict(params), "output": str(out) if out else None, "status": "queued",
                "created": now, "updated": now, "counts": {"succeeded": 0, "failed": 0}}
        _write_json(root / job_id / "job.json", meta)
        return cls(root / job_id, meta)

    @classmethod
    def open(cls, job_id: str) -> "Job":
        path = jobs_dir() / job_id / "job.json"
        meta = _read_meta(path) if re.fullmatch(r"[\w][\w.-]*", job_id) else None
        if meta is None:
            if path.exists():
                raise SpillError(f"{path} is unreadable; restore it from a backup, or {NEW_JOB_HINT}")
            raise SpillError(f"no job {job_id!r} in {jobs_dir()}; `spill status` lists the jobs")
        return cls(path.parent, _true_status(meta))

    @classmethod
    def find(cls, input_path: Path, output_path: Path | None, model: str, finished: bool = False) -> "Job | None":
        """The newest unfinished job for the same input file, output and model (re-running a command continues it);
        with finished=True, the newest done one whose input is unchanged and whose output is still there."""
        inp = str(Path(input_path).resolve())
        out = str(Path(output_path).resolve()) if output_path is not None else None
        for meta in list_jobs():
            if (meta.get("input"), meta.get("output"), meta.get("model")) != (inp, out, model):
                continue
            if not finished and meta.get("status") not in ("done", "cancelled"):
                return cls.open(meta["id"])
            if finished and meta.get("status") == "done" and meta.get("input_sha256") == _sha256(Path(inp)) \
                    and Path(out or jobs_dir() / meta["id"] / "output.jsonl").is_file():
                return cls.open(meta["id"])
        return None

    def settings(self) -> dict:
        """The memory, budget_fraction, stream and KV format the job ran with, as `spill run --resume` starts it again."""
        params = self.meta.get("params", {})
        return {k: params[k] for k in SETTINGS if k in params}

    def done_ids(self) -> set[str]:
        return set(self._done)

    def counts(self) -> dict:
        """{"succeeded": n, "failed": m}: lines in the output, by whether they carry an error."""
        return dict(self._counts)

    def append(self, lines: list[dict]) -> None:
        """Append output lines and fsync before returning; a custom_id already in the output is skipped."""
        with self._mutex:
            chunks, ids, anon, failed = [], set(), set(), 0
            for line in lines:
                cid = line.get("custom_id")
                if cid is None:              # a bad row without custom_id: known by its "line N: ..." message
                    key = (line.get("error") or {}).get("message", "")
                    if key in self._anon or key in anon:
                        continue
                    anon.add(key)
                elif cid in self._done or cid in ids:
                    continue
                else:
                    ids.add(cid)
                chunks.append(encode(line))
                failed += line.get("error") is not None
            if chunks:
                self._write(b"".join(chunks))
            self._done |= ids
            self._anon |= anon
            self._counts["failed"] += failed
            self._counts["succeeded"] += len(chunks) - failed

    def set_status(self, status: str, **fields) -> None:
        """Record status (and any fields) in job.json, rewritten atomically; counts come from the output."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        self.meta.update(fields)
        self.meta.update(status=status, updated=_now(), counts={**self.meta.get("counts", {}), **self._counts})
        _write_json(self.dir / "job.json", self.meta)

    def check_input(self) -> None:
        """SpillError when the input file is gone or differs (sha256) from the one this job was created for."""
        path = Path(self.meta["input"])
        done = f"{len(self._done) + len(self._anon)} rows already in {self.output_path}"
        new = NEW_JOB_HINT + (" and another -o path (that file stays the old job's)" if self.meta.get("output") else "")
        if not path.is_file():
            raise SpillError(f"{path}, the input of job {self.id}, no longer exists; put it back to continue, "
                             f"or {new} ({done})")
        if not self.resumable():
            raise SpillError(f"{path} changed since job {self.id} was created; restore it to continue that job, "
                             f"or {new} ({done} belong to the old input)")

    def resumable(self) -> bool:
        return _resumable(self.meta)

    def lock(self) -> None:
        """Hold this job for this process until close() or exit (a crash releases it too)."""
        if self._lock_fd is not None:
            return
        fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise SpillError(f"job {self.id} is being run by another spill process (pid {pid}); wait for it, "
                             "or stop it with Ctrl-C in its `spill run` or with `spill down`") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        (self.dir / STOP_ASKED).unlink(missing_ok=True)   # an older run's ask; this run starts unasked
        self._done, self._anon, self._counts = set(), set(), {"succeeded": 0, "failed": 0}
        self._load_output()                          # now the only writer: read afresh, repair the tail

    def stop_asked(self) -> bool:
        return (self.dir / STOP_ASKED).exists()

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # output file

    def _busy(self) -> bool:
        """True when another open file holds this job's lock (another process runs it)."""
        return self._lock_fd is None and lock_held(self.dir / "lock")

    def _write(self, data: bytes) -> None:
        fd = _open_output(self.output_path, os.O_WRONLY | os.O_APPEND, self.id)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                _fsync(fd)
            except OSError as err:
                with contextlib.suppress(OSError):   # leave no torn line for the next append to run into
                    os.ftruncate(fd, size)
                if err.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise SpillError(f"no space left to write {self.output_path}; free some space and run the same "
                                     f"command again to continue job {self.id}") from None
                raise SpillError(f"cannot write {self.output_path} ({err.strerror}); fix that and run the same "
                                 f"command again to continue job {self.id}") from None
        finally:
            os.close(fd)

    def _load_output(self) -> None:
        """Create the output if needed, cut a torn tail, and read which custom_ids are done."""
        path = self.output_path
        created = not path.exists()
        with open(_open_output(path, os.O_RDWR, self.id), "r+b") as f:
            data = f.read()
            keep = data.rfind(b"\n") + 1     # a last line without its newline was cut mid-write
            lines = data[:keep].split(b"\n")[:-1]
            while lines and _parse(lines[-1]) is None:
                keep -= len(lines.pop()) + 1
            if keep < len(data) and not self._busy():   # a live writer's tail is not torn, only unfinished
                f.truncate(keep)
                f.flush()
                _fsync(f.fileno())
                self.repaired_bytes = len(data) - keep
                import structlog   # imported here: `spill run` checks its files without loading the logging stack
                structlog.get_logger(__name__).warning("output_tail_repaired", job=self.id, path=str(path),
                                                       dropped_bytes=self.repaired_bytes)
        if created:
            _fsync_dir(path.parent)
        for raw in lines:
            line = _parse(raw)
            if line is None:
                continue
            if line["custom_id"] is None:
                self._anon.add((line.get("error") or {}).get("message", ""))
            else:
                self._done.add(line["custom_id"])
            self._counts["failed" if line.get("error") is not None else "succeeded"] += 1


def lock_held(path: Path) -> bool:
    """True when some process holds this job lock (flock: released when its holder dies)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def check_output_path(out: Path, example: str) -> None:
    """-o names a file in a folder that exists (`example`: a file name to suggest inside a folder given)."""
    if not out.parent.is_dir():
        raise SpillError(f"folder {out.parent} does not exist; create it or choose another -o path")
    if out.is_dir():
        raise SpillError(f"-o {out} is a folder; give a file path such as {out / example}")
    if out.exists() and not out.is_file():
        raise SpillError(f"-o {out} is not a regular file, and spill's output is its record of the rows done; "
                         f"choose a file on a disk, such as {Path.cwd() / example}")


def check_output_free(out: Path) -> None:
    """-o must be a new or empty file: spill appends, and never mixes its rows into someone else's file."""
    check_output_path(out, "results.jsonl")
    if out.exists():
        owner = next((m for m in list_jobs() if m.get("output") == str(out)), None)
        if owner is not None and owner.get("status") == "done" and out.stat().st_size > 0:
            raise SpillError(f"{out} holds the finished output of job {owner['id']}; choose another -o path, "
                             f"or move that file away to run again")
        if owner is not None and owner.get("status") != "done" and not _resumable(owner):
            raise SpillError(f"{out} is the output of job {owner['id']}, whose input changed or is gone since; "
                             f"choose another -o path, or move that file away")
        if owner is not None and owner.get("status") != "done":
            raise SpillError(f"{out} is the output of job {owner['id']} (model {owner.get('model')}, "
                             f"{owner.get('status')}); continue it with `spill run --resume {owner['id']}`, "
                             f"or choose another -o path")
        if out.stat().st_size > 0:
            raise SpillError(f"{out} already exists and is not empty; choose another -o path, or move that file away")


def _resumable(meta: dict) -> bool:
    """The job's input is still there, unchanged: `--resume` can continue it."""
    path = Path(meta.get("input", ""))
    return path.is_file() and _sha256(path) == meta.get("input_sha256")


def _claim_output(out: Path) -> None:
    """Create -o now, exclusively and without following links: a symlink planted after the check is refused."""
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        fd = None                        # an empty file the check accepted; _open_output refuses a link
    except OSError as err:
        raise SpillError(f"cannot create -o {out} ({err.strerror}); choose a path in a folder you can write") from None
    if fd is not None:
        os.close(fd)
        _fsync_dir(out.parent)
    fd = _open_output(out, os.O_RDONLY)
    try:
        _fsync(fd)
    except OSError as err:               # /proc, say: rows written there could not be made durable
        raise SpillError(f"-o {out} cannot be flushed to disk ({err.strerror}), and spill's output is its record "
                         "of the rows done; choose a file on a disk") from None
    finally:
        os.close(fd)


def _open_output(path: Path, flags: int, job_id: str = "") -> int:
    """An fd of the output (created 0600), never through a symlink; one sentence when it cannot be opened."""
    try:
        return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise SpillError(f"{path} is a symbolic link; spill writes only to a regular file, "
                             "give the real path with -o") from None
        job = f" for job {job_id}" if job_id else ""
        raise SpillError(f"cannot open {path} ({err.strerror}){job}; fix that and run the same "
                         "command again, or choose another -o path") from None


def _parse(raw: bytes) -> dict | None:
    """One output line as written by append, or None (torn, blank or foreign)."""
    try:
        line = json.loads(raw)
    except ValueError:
        return None
    return line if isinstance(line, dict) and "custom_id" in line else None


def _read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and "id" in meta else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except FileNotFoundError:
        raise SpillError(f"input file {path} not found; check the path") from None
    return h.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    with replaced(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(fd, "wb") as f:
            f.write(json.dumps(obj, indent=2, ensure_ascii=False).encode("utf-8") + b"\n")
            f.flush()
            _fsync(f.fileno())
    _fsync_dir(path.parent)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
