"""The memory the reader reads into: MLX's, backed by huge pages where Linux can."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

# in a fresh process: MLX's cache and glibc's heap in this one may hand back memory an earlier test made huge
SCRIPT = """
from pathlib import Path
from spill.streamer.mlx_buffers import host_buffer
view, (raw, skip) = host_buffer(24 << 20)
assert view.nbytes == 24 << 20 and view.ctypes.data % 4096 == 0
view[:] = 7
assert int(raw[skip + (5 << 20)].item()) == 7   # still the array's memory
addr, kb, inside = view.ctypes.data, 0, False
for line in Path("/proc/self/smaps").read_text().splitlines():
    head = line.split()[0]
    if "-" in head and ":" not in head:
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo <= addr < hi
    elif inside and head == "AnonHugePages:":
        kb += int(line.split()[1])
print(kb)
"""


def _huge_kb(huge_pages: str) -> int:
    """AnonHugePages (kB) of the mapping holding a new 24 MiB host buffer, SPILL_HUGE_PAGES=`huge_pages`."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SPILL_HUGE_PAGES": huge_pages})
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def _thp() -> str:
    """Transparent huge pages' mode on Linux 6.1+ (MADV_COLLAPSE), else ''."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not path.exists():
        return ""
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return path.read_text().split("[")[1].split("]")[0] if (major, minor) >= (6, 1) else ""


@pytest.mark.skipif(_thp() in ("", "never"), reason="needs Linux 6.1+ with transparent huge pages not set to never")
def test_the_mlx_memory_a_layer_is_read_into_is_backed_by_huge_pages():
    # O_DIRECT into 4 KiB pages: lean45 read at 1.5-1.9 GB/s, 0.30-0.38 s of system CPU a pass; huge: 3.3-3.5 GB/s
    assert _huge_kb("1") >= 16 << 10   # at least 8 of its 12 whole 2 MiB pages


@pytest.mark.skipif(_thp() != "madvise", reason="needs Linux 6.1+ with transparent huge pages on madvise only")
def test_spill_huge_pages_0_leaves_mlxs_own_pages():
    assert _huge_kb("0") == 0
