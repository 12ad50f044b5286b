"""Configuration read from the environment, declared once with its defaults."""

import os
from pathlib import Path


def check_writable(run_dir: Path) -> None:
    """SpillError naming SPILL_HOME when a folder of the data home cannot be made or written."""
    import tempfile
    from .errors import SpillError
    try:
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=run_dir).close()
    except OSError as err:
        raise SpillError(f"cannot write to {run_dir} ({err.strerror}); set SPILL_HOME to a folder you can write "
                         f"(the data home is {home()})") from None


def home() -> Path:
    """The data home: models/, jobs/, calibration/, run/, cache/ (SPILL_HOME, default ~/.streamweights)."""
    return Path(os.environ.get("SPILL_HOME", "~/.streamweights")).expanduser()


def crash_knob(role: str) -> str:
    """Fault injection for tests: SPILL_CRASH_<ROLE>="event:n" crashes that actor at its n-th event."""
    return os.environ.get(f"SPILL_CRASH_{role.upper()}", "")


def ready_timeout() -> float:
    """Seconds an actor has to say READY after start (SPILL_READY_TIMEOUT, default 120)."""
    return float(os.environ.get("SPILL_READY_TIMEOUT", "120"))


def max_rows() -> int:
    """Slots of the decode pool, at most (SPILL_MAX_ROWS, default 256); the memory budget sizes it below that."""
    return int(os.environ.get("SPILL_MAX_ROWS", "256"))


def guard_line(gpu: bool = False, fraction: float = 0.0) -> float:
    """Share of the working set above which admission admits nothing (SPILL_GUARD_LINE, default 0.80; 0.93 on a
    CUDA GPU's own memory, `gpu`: 3 points above its budget as 0.80 is 2 above 0.78), and 2 points above a
    budget `fraction` set higher."""
    if os.environ.get("SPILL_GUARD_LINE"):
        return float(os.environ["SPILL_GUARD_LINE"])
    return min(1.0, max(0.93 if gpu else 0.80, fraction + 0.02))


def hard_line(gpu: bool = False, fraction: float = 0.0) -> float:
    """Share of the working set above which admission preempts the newest rows (SPILL_HARD_LINE, default 0.90;
    0.97 on a CUDA GPU's own memory), and 4 points above a budget `fraction` set higher."""
    if os.environ.get("SPILL_HARD_LINE"):
        return float(os.environ["SPILL_HARD_LINE"])
    return min(1.0, max(0.97 if gpu else 0.90, fraction + 0.04))


def prefill_tokens() -> int:
    """Prompt tokens admitted per pass, at most (SPILL_PREFILL_TOKENS, default 4096)."""
    return int(os.environ.get("SPILL_PREFILL_TOKENS", "4096"))


def test_pass_delay() -> float:
    """For tests: seconds the streamer sleeps after each pass, to widen a race (SPILL_TEST_PASS_DELAY)."""
    return float(os.environ.get("SPILL_TEST_PASS_DELAY", "0"))


def test_estimate_delay() -> float:
    """For tests: seconds a submitted job's estimate waits before it starts, as a slow one would (SPILL_TEST_ESTIMATE_DELAY)."""
    return float(os.environ.get("SPILL_TEST_ESTIMATE_DELAY", "0"))


def test_drop() -> tuple[str, int]:
    """For tests: SPILL_TEST_DROP="SUBMIT:n" loses the n-th message of that kind a process sends, as ZeroMQ
    loses an oversized frame: ("SUBMIT", n); ("", 0) unset."""
    kind, _, n = os.environ.get("SPILL_TEST_DROP", "").partition(":")
    return (kind.upper(), int(n)) if n else ("", 0)


def test_alloc_fail() -> tuple[int, bool]:
    """For tests: SPILL_TEST_ALLOC_FAIL=n makes the n-th buffer the weight reader allocates raise, as MLX does where it
    cannot allocate (Metal), in a group's first streamer; "n:every" in each one that replaces it too: (n, every).
    n 0, unset: never."""
    n, _, every = os.environ.get("SPILL_TEST_ALLOC_FAIL", "").partition(":")
    return int(n or 0), every == "every"


def read_threads() -> int:
    """Threads reading one layer's chunks at once (SPILL_READ_THREADS, default 4): queue depth for the disk."""
    return max(1, int(os.environ.get("SPILL_READ_THREADS", "4")))


def convert_threads() -> int:
    """Threads converting a layer's tensors into MLX arrays (SPILL_CONVERT_THREADS, default half the
    cores, at most 8)."""
    default = max(1, min(8, (os.cpu_count() or 2) // 2))
    return max(1, int(os.environ.get("SPILL_CONVERT_THREADS", str(default))))


def blas_threads() -> int:
    """OpenBLAS threads for the layer math on the CPU (SPILL_BLAS_THREADS, default 0: OpenBLAS's own,
    one per core); fewer leave cores to the reader's threads."""
    return max(0, int(os.environ.get("SPILL_BLAS_THREADS", "0")))


def read_slots() -> int:
    """Layers read ahead into buffers of their own, besides the one computing and the next one ready
    (SPILL_READ_SLOTS; 0, the default: `platform.read_slots` chooses). Each costs a layer of memory."""
    return max(0, int(os.environ.get("SPILL_READ_SLOTS") or 0))


def layers_in_flight() -> int:
    """Converted layers alive at once while streaming, 1 or 2 (SPILL_LAYERS_IN_FLIGHT; 0, the default:
    `platform.layers_in_flight` chooses)."""
    return min(2, max(0, int(os.environ.get("SPILL_LAYERS_IN_FLIGHT") or 0)))


def activation_streams() -> int | None:
    """CPU streams a large SwiGLU and a prompt's attention are split over (SPILL_ACT_STREAMS; 1 turns it off; unset:
    `platform.activation_streams` chooses)."""
    return int(os.environ["SPILL_ACT_STREAMS"]) if os.environ.get("SPILL_ACT_STREAMS") else None


def direct_io() -> bool:
    """Read weights with O_DIRECT where the OS and the file system allow it (SPILL_DIRECT_IO, default 1;
    0 reads through the page cache, dropping behind)."""
    return os.environ.get("SPILL_DIRECT_IO", "1") != "0"


def huge_pages() -> bool:
    """Back the MLX memory weights are read into with huge pages where Linux can (SPILL_HUGE_PAGES, default 1;
    0 leaves MLX's 4 KiB pages: for comparison, or a kernel where collapsing them costs more than it saves)."""
    return os.environ.get("SPILL_HUGE_PAGES", "1") != "0"


def read_into() -> str | None:
    """SPILL_READ_INTO: "mlx" (each layer read straight into MLX-owned memory, its tensors views of it),
    "buffers" (into the reader's own buffers, then copied out) or "pinned" (into its own page-locked buffers,
    then copied by a CUDA GPU's copy engine; "buffers" without one); None: the device's default (platform.py)."""
    chosen = os.environ.get("SPILL_READ_INTO") or None
    if chosen not in (None, "mlx", "buffers", "pinned"):
        from .errors import SpillError
        raise SpillError(f"SPILL_READ_INTO={chosen} is not a reader setting: use mlx, buffers or pinned, "
                         "or unset it for the device's default")
    return chosen


def max_message_bytes() -> int:
    """Frames larger than this are refused on every socket (SPILL_MAX_MESSAGE_MB, default 256)."""
    return int(float(os.environ.get("SPILL_MAX_MESSAGE_MB", "256")) * (1 << 20))


def liveness_timeout() -> float:
    """Seconds without a heartbeat before an actor counts as hung and is restarted (SPILL_LIVENESS_TIMEOUT, default 30).
    The heartbeat comes from a thread, so a long pass keeps beating; a stopped or wedged process does not."""
    return float(os.environ.get("SPILL_LIVENESS_TIMEOUT", "30"))


def stall_timeout() -> float:
    """Seconds every actor may sit idle while rows of the running job are out before the coordinator takes them
    for lost on the way and submits them again (SPILL_STALL_TIMEOUT, default 30)."""
    return float(os.environ.get("SPILL_STALL_TIMEOUT", "30"))


def wedge_timeout(pass_s: float = 0.0) -> float:
    """Seconds an actor may work without its loop coming round before it counts as wedged and is restarted: the
    larger of SPILL_WEDGE_TIMEOUT (default 600; a first pass reads the whole model) and 10 of the last pass."""
    return max(float(os.environ.get("SPILL_WEDGE_TIMEOUT", "600")), 10 * pass_s)


def allow_remote() -> bool:
    """Let the control socket listen on an address other hosts can reach (SPILL_ALLOW_REMOTE=1; `spill up --allow-remote`)."""
    return os.environ.get("SPILL_ALLOW_REMOTE", "") == "1"


def client_timeout() -> float:
    """Seconds a queued job waits for its `spill run` to ask about it before it leaves the queue
    (SPILL_CLIENT_TIMEOUT, default 10): a killed client's job does not run unattended later."""
    return float(os.environ.get("SPILL_CLIENT_TIMEOUT", "10"))


def metrics_host() -> str:
    """Address the group's metrics endpoint listens on (SPILL_METRICS_HOST, default loopback only)."""
    return os.environ.get("SPILL_METRICS_HOST", "127.0.0.1")


def metrics_port() -> int:
    """Port of the group's Prometheus endpoint (SPILL_METRICS_PORT, default 9464; 0 serves none)."""
    return int(os.environ.get("SPILL_METRICS_PORT", "9464"))


def log_max_bytes() -> int:
    """Size at which an actor's JSON log rotates (SPILL_LOG_MAX_BYTES, default 20 MB)."""
    return int(os.environ.get("SPILL_LOG_MAX_BYTES", str(20 * 10**6)))


def log_backups() -> int:
    """Rotated log files kept per actor besides the live one (SPILL_LOG_BACKUPS, default 3)."""
    return int(os.environ.get("SPILL_LOG_BACKUPS", "3"))


LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level() -> str:
    """Lowest level the actors log (SPILL_LOG_LEVEL, default info; warning drops the per-pass lines)."""
    level = os.environ.get("SPILL_LOG_LEVEL", "info").strip().lower()
    if level not in LOG_LEVELS:
        from .errors import SpillError
        raise SpillError(f"SPILL_LOG_LEVEL={os.environ['SPILL_LOG_LEVEL']!r} is not a log level; "
                         f"set it to {', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]}, or unset it")
    return level


def estimate_apart() -> bool:
    """Make a submitted job's estimate (its tokens counted, a new model calibrated) in a child process
    (SPILL_ESTIMATE_APART, default 1): the coordinator then holds no tokenizer for the group's life (47 MB on
    lean45, `benchmarks/group_memory.py`), and each job pays the child's start (~3 s). 0: in a thread of the coordinator (the test suite's many short jobs)."""
    return os.environ.get("SPILL_ESTIMATE_APART", "1") not in ("", "0")


def stream() -> bool:
    """Stream every job's weights from disk even where the model and the job's KV fit resident
    (SPILL_STREAM=1; `spill run --stream`). Default 0: the advisor keeps a model that fits resident."""
    return os.environ.get("SPILL_STREAM", "0") not in ("", "0")


BUDGET_FRACTION = 0.78   # --budget-fraction: the share of the working set live allocation aims at
# ... on a CUDA GPU, whose own memory holds no page cache and nothing of the OS's: no knee to stay under, and the
# GPU sheet priced the H200's peak 265-500 MiB above MLX's at a 3 GiB cap (`benchmarks/peers.py`); the host's stays 0.78
GPU_BUDGET_FRACTION = 0.90


def submit_window() -> int:
    """Rows of a job submitted to the group and not yet finished, at most (SPILL_SUBMIT_WINDOW, default
    1024): the coordinator feeds more as rows finish, so the group's memory does not grow with the job.
    Keep it well above the largest batch admission can run."""
    return int(os.environ.get("SPILL_SUBMIT_WINDOW", "1024"))
