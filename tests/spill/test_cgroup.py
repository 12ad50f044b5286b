"""The cgroup test utility against the real kernel: a smaller machine, page cache charged."""

import os
import subprocess
import sys

from ..cgroup_util import child_cgroup, drop_cache

MIB = 2**20


def test_spill_sees_the_child_limit_as_its_working_set():
    with child_cgroup(300 * MIB) as cg:
        out = cg.run([sys.executable, "-c", "from spill.memory import working_set as w; print(w())"],
                     capture_output=True, text=True, check=True).stdout
        path = cg.path
    assert out.strip() == f"WorkingSet(bytes={300 * MIB}, source='cgroup')"
    assert not path.exists()


def test_page_cache_is_charged_and_an_allocation_over_the_limit_is_oom_killed(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(os.urandom(96 * MIB))
    drop_cache([big])
    with child_cgroup(64 * MIB) as cg:
        cg.run(["cat", big], stdout=subprocess.DEVNULL, check=True)   # cache is reclaimed: no kill
        assert cg.oom_kills() == 0 and cg.peak() > 48 * MIB
        hog = cg.run([sys.executable, "-c", "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096])"],
                     capture_output=True)
        assert hog.returncode == -9 and cg.oom_kills() == 1


def test_a_child_cgroup_can_be_made_under_a_given_parent():
    from ..machine import ChildCgroup
    with child_cgroup(300 * MIB) as outer:
        inner = ChildCgroup("inner", 100 * MIB, parent=outer.path)
        try:
            assert inner.path.parent == outer.path and inner.version == outer.version
            limit = "memory.limit_in_bytes" if inner.version == 1 else "memory.max"
            assert int((inner.path / limit).read_text()) == 100 * MIB
        finally:
            inner.remove()
        assert not inner.path.exists()
