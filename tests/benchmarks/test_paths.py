"""The benchmarks run from a checkout against an installed spill (the device machines install it with pip)."""

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_a_benchmark_puts_the_checkout_after_the_installed_packages():
    """The checkout's spill/ folder holds none of the actors (they install as spill.<actor> from top-level
    folders), so a checkout ahead of site-packages hides them: peers.py failed with "No module named
    'spill.tokenizer_worker'" on a machine where spill was installed with pip --target."""
    ahead = [f"{p.name}: {line.strip()}" for p in sorted(BENCHMARKS.glob("*.py"))
             for line in p.read_text().splitlines()
             if re.match(r"sys\.path\.insert\(", line) and "parents[1]" in line]
    assert ahead == []
