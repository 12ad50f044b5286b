"""The memory the reader reads into: MLX's, backed by huge pages where Linux can."""

import platform
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from spill.streamer.mlx_buffers import host_buffer


def _huge_kb(view: np.ndarray) -> int:
    """AnonHugePages of the mapping that holds `view` (/proc/self/smaps)."""
    addr, kb, inside = view.ctypes.data, 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            kb += int(line.split()[1])
    return kb


def _thp_allowed() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not set to never."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not path.exists() or "[never]" in path.read_text():
        return False
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1)


@pytest.mark.skipif(not _thp_allowed(), reason="needs Linux 6.1+ with transparent huge pages not set to never")
def test_the_mlx_memory_a_layer_is_read_into_is_backed_by_huge_pages():
    # O_DIRECT into 4 KiB pages: lean45 read at 1.5-1.9 GB/s, 0.30-0.38 s of system CPU a pass; huge: 3.3-3.5 GB/s
    view, (raw, skip) = host_buffer(24 << 20)
    assert view.nbytes == 24 << 20 and view.ctypes.data % 4096 == 0
    assert _huge_kb(view) >= 16 << 10   # at least 8 of its 12 whole 2 MiB pages
    view[:] = 7   # still the array's memory
    assert int(raw[skip + (5 << 20)].item()) == 7


@pytest.mark.skipif(not _thp_allowed() or "[madvise]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="needs transparent huge pages on madvise only")
def test_spill_huge_pages_0_leaves_mlxs_own_pages(monkeypatch):
    monkeypatch.setenv("SPILL_HUGE_PAGES", "0")
    mx.clear_cache()   # not memory an earlier buffer left in MLX's cache, huge already
    view, _ = host_buffer(24 << 20)
    assert _huge_kb(view) == 0
