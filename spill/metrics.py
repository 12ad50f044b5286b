"""Every Prometheus metric spill exports, defined once (the dashboard in grafana/ is generated
from these names and checked against them).

The coordinator serves them all on one endpoint (default 127.0.0.1:9464): the actors already
report each pass, each finished row and each error to it, so it holds the job's figures and
keeps counters across actor restarts; what only the OS knows of each actor (resident memory,
CPU, faults) it reads by pid. Why one endpoint and not one per process: docs/observability.md.

Names follow Prometheus's conventions: `spill_` prefix, base units, `_total` on counters,
labels from small fixed sets (tier, phase, kind, reason, actor, state), never a row or job id.
"""

import functools
import os
import time
from importlib import metadata

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase

from .platform import on_cpu, on_cuda

REGISTRY = CollectorRegistry(auto_describe=True)
disable_created_metrics()   # no `_created` series: Prometheus does not need them


class ScrapeClock:
    """Remembers when the endpoint was scraped, so the group can stay up for one more scrape. Registered
    before every metric, so a scrape's time is when it began reading them."""

    def __init__(self):
        self.times: list[float] = []

    def describe(self):
        return []

    def collect(self):
        self.times = [*self.times[-1:], time.monotonic()]
        return []

    def interval(self) -> float | None:
        return self.times[1] - self.times[0] if len(self.times) == 2 else None


SCRAPES = ScrapeClock()
REGISTRY.register(SCRAPES)


class Unset(Gauge):
    """A gauge that exports nothing until first set: no figure rather than a made-up zero."""

    def __init__(self, name: str, documentation: str):
        super().__init__(name, documentation, registry=None)
        self._shown = False

    def set(self, value: float) -> None:
        if not self._shown:
            self._shown = True
            REGISTRY.register(self)
        super().set(value)

    def hide(self) -> None:
        """Export nothing again (a new job whose figure is not known yet)."""
        if self._shown:
            self._shown = False
            REGISTRY.unregister(self)

# Prompt-length tiers (prompt tokens below the bound): the labels of per-row series.
TIERS = ((256, "short"), (1024, "medium"), (float("inf"), "long"))
PASS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
LATENCY_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200)


def tier(prompt_tokens: int) -> str:
    return next(name for bound, name in TIERS if prompt_tokens < bound)


# -- job ------------------------------------------------------------------------------------------
JOB_ROWS = Gauge("spill_job_rows", "Rows of the current (or last) job by state: waiting, running, done, failed.",
                 ["state"], registry=REGISTRY)
JOB_ETA = Unset("spill_job_eta_seconds", "The live view's estimate of the time left in the job.")
JOB_ESTIMATE = Unset("spill_job_estimate_seconds", "The pre-run estimate of the job's total time "
                     "(the line `spill run` prints).")
JOB_ESTIMATE_ERROR = Unset("spill_job_estimate_error_ratio", "Time since the first pass plus the ETA, over "
                           "the pre-run estimate, minus one (after the job: actual over estimate, minus one).")
ROWS_COMPLETED = Counter("spill_rows_completed_total", "Rows written, by prompt tier and finish reason "
                         "(stop, length, or the error code of an error line).", ["tier", "reason"], registry=REGISTRY)
ROW_LATENCY = Histogram("spill_row_latency_seconds", "From a row's submission to the group to its line written.",
                        ["tier"], buckets=LATENCY_BUCKETS, registry=REGISTRY)
PROMPT_TOKENS = Counter("spill_prompt_tokens_total", "Prompt tokens of rows written.", registry=REGISTRY)
GENERATED_TOKENS = Counter("spill_generated_tokens_total",
                           "Completion tokens of rows written (the output's usage.completion_tokens).", registry=REGISTRY)

# -- passes ---------------------------------------------------------------------------------------
PASS_SECONDS = Histogram("spill_pass_duration_seconds", "Time of one pass over the streamed layers.",
                         buckets=PASS_BUCKETS, registry=REGISTRY)
PHASE_SECONDS = Counter("spill_pass_phase_seconds_total", "Pass time by phase: read_wait (compute blocked on "
                        "the reader), compute, overhead (the rest).", ["phase"], registry=REGISTRY)
STREAMED_BYTES = Counter("spill_streamed_bytes_total", "Weight bytes read from disk by passes.", registry=REGISTRY)
DECODE_ROWS = Counter("spill_pass_decode_rows_total", "Decode rows summed over passes (per pass: divide "
                      "by the passes' count).", registry=REGISTRY)
PREFILL_TOKENS = Counter("spill_pass_prefill_tokens_total", "Prompt positions prefilled, summed over passes.",
                         registry=REGISTRY)
DRAFTS = Counter("spill_draft_tokens_total", "Draft tokens decode rows carried through passes (--speculate), by "
                 "outcome: proposed, or accepted (each a token the row took without a pass of its own).", ["outcome"],
                 registry=REGISTRY)
for _outcome in ("proposed", "accepted"):   # both series from the start: a job without drafts counts 0
    DRAFTS.labels(_outcome)
READ_BANDWIDTH = Unset("spill_pass_read_bandwidth_bytes_per_second",
                       "Disk read bandwidth the last pass measured.")
PROBE_BANDWIDTH = Unset("spill_read_probe_bytes_per_second",
                        "Cold read bandwidth of the calibration probe of the job's model on this machine.")

# -- memory ---------------------------------------------------------------------------------------
WORKING_SET = Unset("spill_memory_working_set_bytes", "Memory the machine gives spill (--memory, Metal's, "
                    "the cgroup limit or physical), as admission priced the model.")
BUDGET = Unset("spill_memory_budget_bytes", "Live allocation admission aims at.")
GUARD = Unset("spill_memory_guard_bytes", "Above this live allocation nothing is admitted.")
HARD = Unset("spill_memory_hard_bytes", "Above this live allocation rows are preempted.")
LIVE = Gauge("spill_memory_live_bytes", "Live allocation by kind: the streamer's each pass (mlx_active: MLX's "
             "arrays; mlx_cache: its buffer cache; reader_buffers), admission's other_processes (the group's other "
             "processes' resident memory, as priced).", ["kind"], registry=REGISTRY)
CGROUP_USAGE = Unset("spill_memory_cgroup_usage_bytes", "Bytes charged to the memory cgroup whose limit binds spill "
                     "(else its own), less the inactive page cache the kernel reclaims first; absent where no "
                     "cgroup holds spill.")
PASS_FAULTS = Counter("spill_pass_page_faults_total", "Page faults of the streamer during passes, minor or major.",
                      ["kind"], registry=REGISTRY)
MLX_PEAK = Gauge("spill_mlx_peak_bytes", "MLX's peak memory in the streamer so far.", registry=REGISTRY)
HOLDS = Counter("spill_admission_holds_total", "Passes after which admission held waiting rows back for memory.",
                registry=REGISTRY)
PREEMPTIONS = Counter("spill_preemptions_total", "Rows preempted (KV dropped, queued again, recomputed later).",
                      registry=REGISTRY)

# -- build ----------------------------------------------------------------------------------------
BUILD = Gauge("spill_build_info", "Always 1: spill's version, the MLX backend, the job's model and its KV format.",
              ["version", "backend", "model", "kv"], registry=REGISTRY)

# Known label values start at zero, so rate() sees a series' first increase.
for _, _tier in TIERS:
    ROW_LATENCY.labels(_tier)
    for _reason in ("stop", "length"):
        ROWS_COMPLETED.labels(_tier, _reason)
for _phase in ("read_wait", "compute", "overhead"):
    PHASE_SECONDS.labels(_phase)
for _kind in ("minor", "major"):
    PASS_FAULTS.labels(_kind)

# The one metric that may have no series: the streamer reads the usage of its memory cgroup, and
# where no cgroup holds it (macOS, a Linux without cgroup memory accounting) there is none.
ONLY_WITH_CGROUP = "spill_memory_cgroup_usage_bytes"


def build_info(model: str, kv: str = "unquantized") -> None:
    BUILD.clear()
    BUILD.labels(_version(), _backend(), model, kv).set(1)


@functools.cache
def _version() -> str:
    try:
        return metadata.version("streamweights")
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def _backend() -> str:
    """The device MLX computes on in the streamer, as the supervisor learned it (no MLX imported here)."""
    return "cuda" if on_cuda() else "cpu" if on_cpu() else "metal"


# -- processes (read by pid at scrape time) -------------------------------------------------------
PROCESS_FAMILIES = {
    "spill_actor_up": "1 while the actor process runs.",
    "spill_actor_restarts_total": "Times the coordinator restarted the actor.",
    "spill_process_resident_memory_bytes": "Resident memory of each spill process.",
    "spill_process_cpu_seconds_total": "User and system CPU time of each spill process.",
    "spill_process_page_faults_total": "Page faults of each spill process by kind, minor or major (Linux).",
}


class ProcessCollector:
    """Resident memory, CPU and faults of every spill process, by actor (psutil: Linux and macOS;
    faults from /proc on Linux). `pids()` gives {actor: pid}; `restarts()` {actor: count}."""

    def __init__(self, pids, restarts):
        self.pids, self.restarts = pids, restarts
        self._procs: dict[int, object] = {}

    def describe(self):
        return []

    def collect(self):
        import psutil
        up, restarts, rss, cpu, faults = (
            GaugeMetricFamily("spill_actor_up", PROCESS_FAMILIES["spill_actor_up"], labels=["actor"]),
            CounterMetricFamily("spill_actor_restarts", PROCESS_FAMILIES["spill_actor_restarts_total"], labels=["actor"]),
            GaugeMetricFamily("spill_process_resident_memory_bytes",
                              PROCESS_FAMILIES["spill_process_resident_memory_bytes"], labels=["actor"]),
            CounterMetricFamily("spill_process_cpu_seconds", PROCESS_FAMILIES["spill_process_cpu_seconds_total"],
                                labels=["actor"]),
            CounterMetricFamily("spill_process_page_faults", PROCESS_FAMILIES["spill_process_page_faults_total"],
                                labels=["actor", "kind"]))
        for actor, n in dict(self.restarts()).items():
            restarts.add_metric([actor], n)
        for actor, pid in {"coordinator": os.getpid(), **self.pids()}.items():
            try:
                proc = self._procs.get(pid) or self._procs.setdefault(pid, psutil.Process(pid))
                with proc.oneshot():
                    alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
                    mem, times = proc.memory_info(), proc.cpu_times()
            except psutil.Error:
                alive = False
            up.add_metric([actor], 1 if alive else 0)
            if alive:
                rss.add_metric([actor], mem.rss)
                cpu.add_metric([actor], times.user + times.system)
                for kind, n in _faults(pid).items():
                    faults.add_metric([actor, kind], n)
        yield from (up, restarts, rss, cpu, faults)


def _faults(pid: int) -> dict[str, int]:
    """Minor and major faults from /proc/<pid>/stat (fields 10 and 12); empty where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return {}
    return {"minor": int(fields[7]), "major": int(fields[9])}


def defined_names() -> set[str]:
    """Every metric family name this module exports, counters with their `_total`."""
    names = set(PROCESS_FAMILIES)
    for metric in globals().values():
        if isinstance(metric, MetricWrapperBase):
            names.update(f.name + ("_total" if f.type == "counter" else "") for f in metric.describe())
    return names
