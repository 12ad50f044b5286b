"""The working set and process memory, read from fake /proc and /sys trees."""

import os

import pytest

from spill import memory
from spill.errors import SpillError

V1_MOUNTS = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTS = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
GIB = 2**30


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def machine(root, physical_gib=24):
    write(root, "proc/meminfo", f"MemTotal:       {physical_gib * 2**20} kB\nMemFree: 1 kB\n")


def v1(root, group="/jobs/a", limits=None, usage=None):
    """A v1 tree: our cgroup `group` under /sys/fs/cgroup/memory; limits maps folders to values."""
    machine(root)
    write(root, "proc/self/cgroup", f"4:memory:{group}\n1:cpu:/\n0::/\n")
    write(root, "proc/self/mountinfo", V1_MOUNTS)
    base = "sys/fs/cgroup/memory"
    for folder in ("", "/jobs", group):
        write(root, f"{base}{folder}/memory.limit_in_bytes", "9223372036854771712\n")
    for folder, value in (limits or {}).items():
        write(root, f"{base}{folder}/memory.limit_in_bytes", f"{value}\n")
    for folder, value in (usage or {}).items():
        write(root, f"{base}{folder}/memory.usage_in_bytes", f"{value}\n")


def test_v1_limit_of_our_own_cgroup(tmp_path):
    v1(tmp_path, limits={"/jobs/a": 6 * GIB}, usage={"/jobs/a": 123})
    assert memory.cgroup_limit(tmp_path) == 6 * GIB
    assert memory.cgroup_usage(tmp_path) == 123
    assert memory.working_set(root=tmp_path, metal=lambda: None) == memory.WorkingSet(6 * GIB, "cgroup")


def test_v1_tightest_ancestor_binds_and_its_usage_is_read(tmp_path):
    v1(tmp_path, limits={"/jobs": 4 * GIB, "/jobs/a": 8 * GIB}, usage={"/jobs": 77, "/jobs/a": 5})
    assert memory.cgroup_limit(tmp_path) == 4 * GIB
    assert memory.cgroup_usage(tmp_path) == 77


def test_the_usage_leaves_out_the_inactive_page_cache_the_kernel_reclaims_first(tmp_path):
    """A 1.25 GiB job's cgroup charged 175 MiB of page cache (logs, files read once), 104 MiB of it
    inactive: counted, it put live allocation over admission's guard line with every slot in use."""
    v1(tmp_path, limits={"/jobs": 4 * GIB}, usage={"/jobs": 1000 * 2**20})
    write(tmp_path, "sys/fs/cgroup/memory/jobs/memory.stat",
          "cache 183738368\ninactive_file 0\ntotal_cache 183738368\ntotal_inactive_file 108707840\n")
    assert memory.cgroup_usage(tmp_path) == 1000 * 2**20 - 108707840
    machine(tmp_path)
    write(tmp_path, "proc/self/cgroup", "0::/job\n")
    write(tmp_path, "proc/self/mountinfo", V2_MOUNTS)
    write(tmp_path, "sys/fs/cgroup/job/memory.max", f"{GIB}\n")
    write(tmp_path, "sys/fs/cgroup/job/memory.current", "5000\n")
    write(tmp_path, "sys/fs/cgroup/job/memory.stat", "anon 3000\nfile 2000\ninactive_file 1500\n")
    assert memory.cgroup_usage(tmp_path) == 3500


def test_v1_huge_limit_means_none_and_physical_is_used(tmp_path):
    v1(tmp_path, usage={"/jobs/a": 9})
    assert memory.cgroup_limit(tmp_path) is None
    assert memory.cgroup_usage(tmp_path) == 9
    assert memory.working_set(root=tmp_path, metal=lambda: None) == memory.WorkingSet(24 * GIB, "physical")


def test_a_cuda_gpus_memory_is_the_working_set_and_the_hosts_is_apart(tmp_path):
    """MLX's KV and layers live in the GPU's memory there, larger or smaller than the host's (a cgroup's limit
    does not hold them); the host's buffers and processes are budgeted against the host's memory (host_set)."""
    v1(tmp_path, limits={"/jobs/a": 6 * GIB})
    assert memory.working_set(root=tmp_path, metal=lambda: None, cuda=lambda: 4 * GIB) == memory.WorkingSet(4 * GIB, "cuda")
    assert memory.working_set(root=tmp_path, metal=lambda: None, cuda=lambda: 80 * GIB) == memory.WorkingSet(80 * GIB, "cuda")
    assert memory.host_set(tmp_path) == memory.WorkingSet(6 * GIB, "cgroup")
    assert memory.working_set("2GiB", root=tmp_path, cuda=lambda: GIB).source == "--memory"


def test_a_limit_above_physical_memory_is_no_limit(tmp_path):
    v1(tmp_path, limits={"/jobs/a": 64 * GIB})
    assert memory.working_set(root=tmp_path, metal=lambda: None).source == "physical"


def test_v1_mount_rooted_inside_the_hierarchy(tmp_path):
    """In a container the mount's root is our own cgroup: /proc/self/cgroup names the full path."""
    machine(tmp_path)
    write(tmp_path, "proc/self/cgroup", "4:memory:/docker/abc\n")
    write(tmp_path, "proc/self/mountinfo", "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", f"{2 * GIB}\n")
    assert memory.cgroup_limit(tmp_path) == 2 * GIB


def test_v2_memory_max(tmp_path):
    machine(tmp_path)
    write(tmp_path, "proc/self/cgroup", "0::/user.slice/job\n")
    write(tmp_path, "proc/self/mountinfo", V2_MOUNTS)
    write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    write(tmp_path, "sys/fs/cgroup/user.slice/memory.max", "max\n")
    write(tmp_path, "sys/fs/cgroup/user.slice/job/memory.max", f"{3 * GIB}\n")
    write(tmp_path, "sys/fs/cgroup/user.slice/job/memory.current", "4096\n")
    assert memory.cgroup_limit(tmp_path) == 3 * GIB
    assert memory.cgroup_usage(tmp_path) == 4096
    write(tmp_path, "sys/fs/cgroup/user.slice/job/memory.max", "max\n")
    assert memory.cgroup_limit(tmp_path) is None


def test_no_cgroup_files_means_no_limit(tmp_path):
    machine(tmp_path, physical_gib=16)
    assert memory.cgroup_limit(tmp_path) is None and memory.cgroup_usage(tmp_path) is None
    assert memory.working_set(root=tmp_path, metal=lambda: None) == memory.WorkingSet(16 * GIB, "physical")


def test_override_and_metal_come_first(tmp_path):
    v1(tmp_path, limits={"/jobs/a": 6 * GIB})
    assert memory.working_set("2GiB", root=tmp_path) == memory.WorkingSet(2 * GIB, "--memory")
    assert memory.working_set(5000, root=tmp_path) == memory.WorkingSet(5000, "--memory")
    assert memory.working_set(root=tmp_path, metal=lambda: 36 * GIB) == memory.WorkingSet(36 * GIB, "metal")


def test_process_memory_from_fake_proc(tmp_path):
    # comm with spaces and a parenthesis; minflt is field 10, majflt field 12
    write(tmp_path, "proc/4242/stat", "4242 (a b) c) S 1 4242 4242 0 -1 4194560 1500 0 7 0 5 6 0 0 20 0 1 0 9 1 1\n")
    write(tmp_path, "proc/4242/status", "Name:\ta b\nVmRSS:\t  2048 kB\n")
    assert memory.process_memory(4242, root=tmp_path) == memory.ProcessMemory(2048 * 1024, 1500, 7)


def test_a_process_that_exited_is_a_lookup_error(tmp_path):
    (tmp_path / "proc").mkdir()
    with pytest.raises(ProcessLookupError):
        memory.process_memory(999999, root=tmp_path)


def test_process_memory_of_this_process():
    mine = memory.process_memory()
    assert mine.rss > 1_000_000 and mine.minor_faults > 0
    assert memory.process_memory(os.getpid()).rss > 0


@pytest.mark.parametrize("text,expected", [("48GB", 48 * 10**9), ("1.5GiB", int(1.5 * GIB)),
                                           ("900M", 900 * 10**6), ("4096", 4096), ("2 gib", 2 * GIB)])
def test_parse_size(text, expected):
    assert memory.parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "12XB", "-3GB", "0", ""])
def test_parse_size_refuses_with_one_sentence(text):
    with pytest.raises(SpillError) as err:
        memory.parse_size(text)
    assert "\n" not in str(err.value) and "48GB" in str(err.value)


def test_memory_args_as_the_actors_get_them():
    assert memory.memory_args() == {"memory": None, "budget_fraction": None}   # the group's device chooses
    assert memory.memory_args("2GiB", 1.0) == {"memory": 2 * GIB, "budget_fraction": 1.0}


@pytest.mark.parametrize("size,fraction,says", [
    ("lots", None, "--memory 'lots' is not a size; write it like 48GB, 1.5GiB or 900M"),
    (None, 0.0, "--budget-fraction must be above 0 and at most 1 (the default is 0.78, 0.9 on a CUDA GPU); got 0.0"),
    (None, 1.5, "--budget-fraction must be above 0 and at most 1 (the default is 0.78, 0.9 on a CUDA GPU); got 1.5"),
    (None, float("nan"), "--budget-fraction must be above 0 and at most 1 (the default is 0.78, 0.9 on a CUDA GPU); got nan")])
def test_memory_args_refuse_with_one_sentence(size, fraction, says):
    with pytest.raises(SpillError) as err:
        memory.memory_args(size, fraction)
    assert str(err.value) == says


def test_a_job_naming_other_memory_than_its_group_is_refused():
    group = memory.memory_args("4GiB", 0.5)
    memory.check_same(group, {"memory": None, "budget_fraction": None})
    memory.check_same(group, {"memory": 4 * GIB, "budget_fraction": 0.5})
    with pytest.raises(SpillError, match=r"started with --memory 4.0 GiB; run without --memory, or `spill down`"):
        memory.check_same(group, {"memory": 2 * GIB})
    with pytest.raises(SpillError, match=r"started with --budget-fraction 0.5; run without --budget-fraction"):
        memory.check_same(group, {"budget_fraction": 0.7})


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_the_streamers_library_pages_are_counted_once_with_the_groups():
    """The streamer's runtime maps the libraries the other processes map: its file pages join theirs
    (counted once), and only its own pages add (MLX's CUDA libraries: ~225 MB counted twice before)."""
    alone = memory.group_rss(os.getpid(), skip=b"")
    file = memory.process_memory(os.getpid()).file
    assert file > 0
    runtime = (file // 2 + (64 << 20), file // 2)   # 64 MiB of its own, and library pages we map too
    assert memory.group_rss(os.getpid(), skip=b"", runtime=runtime) == pytest.approx(alone + (64 << 20), abs=4 << 20)
