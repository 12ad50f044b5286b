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
