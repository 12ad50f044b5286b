"""Configuration read from the environment, declared once with its defaults."""

import os
from pathlib import Path


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
    """Rows running at once, at most (SPILL_MAX_ROWS, default 64); the memory-aware policy will set it."""
    return int(os.environ.get("SPILL_MAX_ROWS", "64"))


def prefill_tokens() -> int:
    """Prompt tokens admitted per pass, at most (SPILL_PREFILL_TOKENS, default 4096)."""
    return int(os.environ.get("SPILL_PREFILL_TOKENS", "4096"))


def test_pass_delay() -> float:
    """For tests: seconds the streamer sleeps after each pass, to widen a race (SPILL_TEST_PASS_DELAY)."""
    return float(os.environ.get("SPILL_TEST_PASS_DELAY", "0"))


def read_threads() -> int:
    """Threads reading one layer's chunks at once (SPILL_READ_THREADS, default 4): queue depth for the disk."""
    return max(1, int(os.environ.get("SPILL_READ_THREADS", "4")))


def convert_threads() -> int:
    """Threads converting a layer's tensors into MLX arrays (SPILL_CONVERT_THREADS, default half the
    cores, at most 8)."""
    default = max(1, min(8, (os.cpu_count() or 2) // 2))
    return max(1, int(os.environ.get("SPILL_CONVERT_THREADS", str(default))))


def direct_io() -> bool:
    """Read weights with O_DIRECT where the OS and the file system allow it (SPILL_DIRECT_IO, default 1;
    0 reads through the page cache, dropping behind)."""
    return os.environ.get("SPILL_DIRECT_IO", "1") != "0"


def max_message_bytes() -> int:
    """Frames larger than this are refused on every socket (SPILL_MAX_MESSAGE_MB, default 256)."""
    return int(float(os.environ.get("SPILL_MAX_MESSAGE_MB", "256")) * (1 << 20))


def liveness_timeout() -> float:
    """Seconds without a heartbeat before an actor counts as hung and is restarted (SPILL_LIVENESS_TIMEOUT, default 30).
    The heartbeat comes from a thread, so a long pass keeps beating; a stopped or wedged process does not."""
    return float(os.environ.get("SPILL_LIVENESS_TIMEOUT", "30"))


def allow_remote() -> bool:
    """Let the control socket listen on an address other hosts can reach (SPILL_ALLOW_REMOTE=1; `spill up --allow-remote`)."""
    return os.environ.get("SPILL_ALLOW_REMOTE", "") == "1"


BUDGET_FRACTION = 0.78   # --budget-fraction: the share of the working set live allocation aims at


def submit_window() -> int:
    """Rows of a job submitted to the group and not yet finished, at most (SPILL_SUBMIT_WINDOW, default
    1024): the coordinator feeds more as rows finish, so the group's memory does not grow with the job.
    Keep it well above the largest batch admission can run."""
    return int(os.environ.get("SPILL_SUBMIT_WINDOW", "1024"))
