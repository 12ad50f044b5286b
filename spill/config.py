"""Configuration read from the environment, declared once with its defaults."""

import os
from pathlib import Path


def home() -> Path:
    """The data home: models/, jobs/, calibration/, run/, cache/ (SPILL_HOME, default ~/.streamweights)."""
    return Path(os.environ.get("SPILL_HOME", "~/.streamweights")).expanduser()
