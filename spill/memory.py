"""How much memory this machine gives us, and what a process holds of it.

The working set is the first of: `--memory`, Metal's recommended working set (Apple silicon), a CUDA GPU's
memory (with the host's budgeted apart: host_apart), the least of the limit of our own cgroup (v2 `memory.max`,
v1 `memory.limit_in_bytes`, the tightest of our cgroup and its ancestors) and physical memory. Every reader
takes `root`, the filesystem root, so tests point it at a fake /proc and /sys tree.
"""

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .config import BUDGET_FRACTION, GPU_BUDGET_FRACTION
from .errors import SpillError
from .platform import device_memory

NO_LIMIT = 1 << 60     # a cgroup limit at or above this means none (v1 writes 2**63 - 4096)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class WorkingSet:
    bytes: int
    source: str        # "--memory", "metal", "cgroup", "physical" or "cuda"


@dataclass(frozen=True)
class ProcessMemory:
    rss: int
    minor_faults: int
    major_faults: int
    file: int = 0          # of rss, pages mapped from files (shared libraries): one copy however many map them


def parse_size(text: str) -> int:
    """'48GB' -> 48*10**9, '1.5GiB' -> 1.5*2**30, '900M' -> 900*10**6, '4096' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise SpillError(f"cannot read {text!r} as a memory size; write it like 48GB, 1.5GiB or 900M")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise SpillError(f"the memory size {text!r} is not above zero; give a size like 48GB")
    return size


def format_size(n: int) -> str:
    """Bytes as GiB, MiB or KiB with one decimal (bytes below a KiB), for people."""
    if n < 2**10:
        return f"{n} bytes"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# -- cgroups ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Cgroup:
    path: Path         # our cgroup's folder
    mount: Path        # the hierarchy's mount point
    version: int


def _own_cgroup(root: Path) -> _Cgroup | None:
    """Our memory cgroup's folder, from /proc/self/cgroup and /proc/self/mountinfo (v1 first)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    paths = {}    # version -> our path inside that hierarchy
    for line in lines:
        ident, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            paths[1] = path
        elif ident == "0" and not controllers:
            paths[2] = path
    for version in (1, 2):
        for mount_root, mount_point in _mounts(mounts, version) if version in paths else ():
            try:
                inside = PurePosixPath(paths[version]).relative_to(mount_root)
            except ValueError:
                continue   # our cgroup is not visible under this mount
            mount = root / mount_point.lstrip("/")
            return _Cgroup(mount / inside, mount, version)
    return None


def own_cgroup(root: Path | str = "/") -> tuple[Path, int] | None:
    """Our memory cgroup's folder and its version (1 or 2), or None where there is none."""
    cg = _own_cgroup(Path(root))
    return (cg.path, cg.version) if cg else None


def _mounts(mountinfo: list[str], version: int):
    """(root inside the hierarchy, mount point) of each cgroup mount of that version."""
    for line in mountinfo:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not tail or len(fields) < 5:
            continue
        if (version == 1 and tail[0] == "cgroup" and "memory" in tail[-1].split(",")) or \
                (version == 2 and tail[0] == "cgroup2"):
            yield fields[3], fields[4]


def _read_number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < NO_LIMIT else None


def _limit_file(version: int) -> str:
    return "memory.limit_in_bytes" if version == 1 else "memory.max"


def _tightest(cg: _Cgroup) -> tuple[int, Path] | None:
    """The smallest limit on our cgroup and its ancestors up to the mount, with its folder."""
    best, folder = None, cg.path
    while True:
        limit = _read_number(folder / _limit_file(cg.version))
        if limit is not None and (best is None or limit < best[0]):
            best = (limit, folder)
        if folder == cg.mount or cg.mount not in folder.parents:
            return best
        folder = folder.parent


def cgroup_limit(root: Path | str = "/") -> int | None:
    """Bytes our memory cgroup (or an ancestor) may use, or None where no limit is set."""
    cg = _own_cgroup(Path(root))
    best = cg and _tightest(cg)
    return best[0] if best else None


def cgroup_usage(root: Path | str = "/") -> int | None:
    """Bytes charged to the cgroup whose limit binds us (else to our own) less its inactive page cache,
    which the kernel reclaims first (a finished log's pages, a file read once): what a limit presses on."""
    cg = _own_cgroup(Path(root))
    if cg is None:
        return None
    best = _tightest(cg)
    folder = best[1] if best else cg.path
    name = "memory.usage_in_bytes" if cg.version == 1 else "memory.current"
    try:
        usage = int((folder / name).read_text().strip())
    except (OSError, ValueError):
        return None
    key = "total_inactive_file" if cg.version == 1 else "inactive_file"   # v1: with the cgroups below
    try:
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if line.strip())
        return max(usage - int(stat.get(key, 0)), 0)
    except (OSError, ValueError):
        return usage


# -- the working set ------------------------------------------------------------------------------
def physical_memory(root: Path | str = "/") -> int:
    meminfo = Path(root) / "proc/meminfo"
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def metal_working_set() -> int | None:
    """Metal's recommended working set on Apple silicon, else None (MLX imported only there)."""
    if sys.platform != "darwin":
        return None
    try:
        import mlx.core as mx
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    except Exception:  # noqa: BLE001 - no Metal device: fall through to the next source
        return None
    size = info.get("max_recommended_working_set_size")
    return int(size) if size else None


def working_set(override: int | str | None = None, root: Path | str = "/", metal=metal_working_set,
                cuda=device_memory) -> WorkingSet:
    """The memory spill plans its arrays in: --memory, else Metal's, else a CUDA GPU's (weights in flight, KV and
    activations live there; the host's own memory is budgeted apart: host_set), else the host's."""
    if override is not None:
        return WorkingSet(parse_size(override) if isinstance(override, str) else int(override), "--memory")
    size = metal()
    if size:
        return WorkingSet(size, "metal")
    gpu = cuda()
    return WorkingSet(gpu, "cuda") if gpu else host_set(root)


def host_apart(root: Path | str = "/") -> WorkingSet | None:
    """The host's memory where it is budgeted apart from the working set (a CUDA GPU's), else None."""
    return host_set(root) if device_memory() else None


def default_fraction() -> float:
    """The budget's share of the working set where --budget-fraction is not given: a CUDA GPU's own memory
    (host apart) holds no page cache, so more of it than of unified or host memory."""
    return GPU_BUDGET_FRACTION if device_memory() else BUDGET_FRACTION


def host_set(root: Path | str = "/") -> WorkingSet:
    """The host's memory: the least of the cgroup's limit and physical memory."""
    physical = physical_memory(root)
    limit = cgroup_limit(root)
    return WorkingSet(limit, "cgroup") if limit is not None and limit < physical else WorkingSet(physical, "physical")


# -- the group's settings --------------------------------------------------------------------------
def memory_args(memory: str | None = None, budget_fraction: float | None = None) -> dict:
    """--memory and --budget-fraction checked, as the actors get them: memory (bytes or None), budget_fraction
    (None where not given: each group takes its device's default, `default_fraction`)."""
    if budget_fraction is not None and not 0 < budget_fraction <= 1:
        raise SpillError(f"--budget-fraction must be above 0 and at most 1 (the default is {BUDGET_FRACTION}, "
                         f"{GPU_BUDGET_FRACTION} on a CUDA GPU); got {budget_fraction}")
    try:
        size = None if memory is None else parse_size(memory)
    except SpillError:
        raise SpillError(f"--memory {memory!r} is not a size; write it like 48GB, 1.5GiB or 900M") from None
    return {"memory": size, "budget_fraction": budget_fraction}


def budget_bytes(memory_arg=None, fraction: float | None = None) -> int:
    """The budget of --memory (or a WorkingSet; None: this machine's) and --budget-fraction (None: the default)."""
    ws = memory_arg if isinstance(memory_arg, WorkingSet) else working_set(memory_arg)
    return int(ws.bytes * (fraction or default_fraction()))


def describe(args: dict) -> dict:
    """What a group plans for: working_set, source, budget_fraction, budget (bytes); on a CUDA GPU also the host's
    memory (host, host_source), which its buffers and processes are budgeted against."""
    ws = working_set(args.get("memory"))
    fraction = args.get("budget_fraction") or default_fraction()
    host = host_apart()
    return {"working_set": ws.bytes, "source": ws.source, "budget_fraction": fraction, "budget": int(ws.bytes * fraction),
            **({"host": host.bytes, "host_source": host.source} if host else {})}


def check_same(group: dict, asked: dict) -> None:
    """A job that names --memory or --budget-fraction must name what the running group was started with."""
    for key, flag in (("memory", "--memory"), ("budget_fraction", "--budget-fraction")):
        if asked.get(key) is not None and asked[key] != group.get(key):
            now = group.get(key)
            now = "none" if now is None else format_size(now) if key == "memory" else now
            raise SpillError(f"the running group was started with {flag} {now}; run without {flag}, "
                             f"or `spill down` and run again to start a group with the new value")


def describe_line(d: dict) -> str:
    host = f"; the host's {format_size(d['host'])} ({d['host_source']}) apart" if d.get("host") else ""
    return (f"memory: working set {format_size(d['working_set'])} ({d['source']}), "
            f"budget {d['budget_fraction']:.0%} = {format_size(d['budget'])}{host}")


# -- one process ------------------------------------------------------------------------------------
def cache_allowance(layer: int, cast: int, largest: int, recycled: bool = False) -> int:
    """MLX's buffer cache before the KV's share, as admission prices it and the reader sets it: the freed layer the
    next conversion takes (none where the reader reads into it: `recycled`, tensors not cast), the stored copies a
    cast frees and the largest tensor."""
    return (0 if recycled and not cast else layer) + cast + largest


def process_memory(pid: int | None = None, root: Path | str = "/") -> ProcessMemory:
    """Resident bytes and page faults so far of a process (this one by default)."""
    pid = os.getpid() if pid is None else pid
    proc = Path(root) / "proc" / str(pid)
    if (Path(root) / "proc").is_dir() and not proc.exists():
        raise ProcessLookupError(f"no process with pid {pid}")   # Linux: it has exited
    if proc.exists():
        stat = (proc / "stat").read_text()
        after = stat[stat.rindex(")") + 2:].split()   # fields from the 3rd on; comm may hold spaces
        kb = {line.split(":")[0]: int(line.split()[1]) for line in (proc / "status").read_text().splitlines()
              if line.startswith(("VmRSS:", "RssFile:"))}
        return ProcessMemory(kb["VmRSS"] * 1024, int(after[7]), int(after[9]), kb.get("RssFile", 0) * 1024)
    return _ps_memory(pid)


def _ps_memory(pid: int) -> ProcessMemory:
    """macOS: ps reports rss in KiB and minflt/majflt (page reclaims and faults)."""
    out = subprocess.run(["ps", "-o", "rss=,minflt=,majflt=", "-p", str(pid)],
                         capture_output=True, text=True, check=False).stdout.split()
    if len(out) < 3:
        raise SpillError(f"no process with pid {pid}")
    return ProcessMemory(int(out[0]) * 1024, int(out[1]), int(out[2]))


STREAMER = b"spill.streamer.process"   # the streamer's module, as its command line names it


def group_rss(parent: int, skip: bytes = STREAMER, runtime: tuple = (0, 0)) -> int:
    """Resident memory of `parent` and its children (on Linux, from /proc), shared library pages once,
    leaving out any whose command line names the module `skip` (the streamer), and adding its `runtime`
    (RSS, of it file pages) at READY. Admission prices the group with it, and the coordinator's estimate."""
    pids = {parent}
    try:
        pids |= {int(p) for p in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()}
    except OSError:
        pass
    own, shared = runtime[0] - runtime[1], runtime[1]
    for pid in pids:
        try:   # every actor's arguments name the streamer's endpoint: match its module, not a substring
            if skip and skip in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                continue
            pm = process_memory(pid)
        except (OSError, SpillError, StopIteration, KeyError):
            continue   # a process that has just gone
        own, shared = own + pm.rss - pm.file, max(shared, pm.file)
    return own + shared   # the libraries' file pages are one copy, mapped by each process
