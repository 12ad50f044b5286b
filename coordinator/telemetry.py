"""The coordinator's side of the metrics: it feeds spill/metrics.py from what the actors report and
serves them on one endpoint. The daemon calls `on_actor` with each message before the group
handles it (so a row still pending is known to be newly written) and `update` once per loop. It keeps
no row's state: a row's submission time is the job run's, the rows running are admission's count."""

import socket
import time

import structlog
from prometheus_client import start_http_server

from spill import config
from spill import messages as m
from spill import metrics as mt
from spill.errors import SpillError


class Telemetry:
    def __init__(self, group, log, host: str | None = None, port: int | None = None):
        """host, port: `spill up --metrics-host/--metrics-port` where given, else SPILL_METRICS_HOST/PORT."""
        self.group, self.log = group, log
        self.host, self.port = host or config.metrics_host(), config.metrics_port() if port is None else port
        self.run = None                      # the current job's JobRun, or the last one's
        self.running = 0                     # rows prefilling or decoding, as admission last counted them
        self.epoch = group.epoch
        self.clock = mt.SCRAPES
        self.server = None
        self.processes = mt.ProcessCollector(group.sup.pids, lambda: group.sup.restarts)
        mt.REGISTRY.register(self.processes)
        mt.build_info("")
        self.serve(self.host, self.port)

    def serve(self, host: str, port: int) -> None:
        """Serve on host:port; a port in use is logged, never fatal (`spill up` checks it first)."""
        if port == 0:
            return
        try:
            self.server, _thread = start_http_server(port, addr=host, registry=mt.REGISTRY)
            self.log.info("metrics endpoint", url=f"http://{host}:{port}/metrics")
        except OSError as err:
            self.log.warning("metrics endpoint not served", host=host, port=port, error=str(err))

    # -- messages ------------------------------------------------------------------------------
    def on_actor(self, msg) -> None:
        if isinstance(msg, m.Budget):   # admission's figures stand whatever the job
            _budget(msg)
            if msg.epoch == self.group.epoch:
                self.running = msg.running_rows
            return
        run = self.group.current
        if run is None:
            return
        stale = getattr(msg, "epoch", self.group.epoch) != self.group.epoch   # rows are written whatever their epoch
        if isinstance(msg, m.Pass) and not stale:
            self._pass(msg)
        elif isinstance(msg, m.Done):
            for row, finish, p, c in zip(msg.rows, msg.finish, msg.prompt_tokens, msg.completion_tokens):
                if row in run.pending:
                    self._written(run, row, mt.tier(p), finish)
                    mt.PROMPT_TOKENS.inc(p)
                    mt.GENERATED_TOKENS.inc(c)
        elif isinstance(msg, m.Error):
            for row, code in zip(msg.rows, msg.codes):
                if row in run.pending:
                    self._written(run, row, "unknown", code)

    @staticmethod
    def _written(run, row: int, tier: str, reason: str) -> None:
        """A row written: its latency from its submission to the group (the job run's record of it)."""
        mt.ROWS_COMPLETED.labels(tier, reason).inc()
        start = run.in_flight.get(row)
        if start is not None:
            mt.ROW_LATENCY.labels(tier).observe(time.monotonic() - start)

    def _pass(self, msg: m.Pass) -> None:
        structlog.contextvars.bind_contextvars(pass_index=msg.index)
        mt.PASS_SECONDS.observe(msg.seconds)
        overhead = max(msg.seconds - msg.wait_s - msg.compute_s, 0.0)
        for phase, s in (("read_wait", msg.wait_s), ("compute", msg.compute_s), ("overhead", overhead)):
            mt.PHASE_SECONDS.labels(phase).inc(s)
        mt.STREAMED_BYTES.inc(msg.bytes_streamed)
        mt.DECODE_ROWS.inc(msg.decode_rows)
        mt.PREFILL_TOKENS.inc(msg.prefill_tokens)
        mt.DRAFTS.labels("proposed").inc(sum(n for _, n in msg.drafted))
        mt.DRAFTS.labels("accepted").inc(sum(n for _, n in msg.accepted))
        _memory(msg)
        self.log.info("pass", seconds=round(msg.seconds, 4), read_wait_s=round(msg.wait_s, 4),
                      compute_s=round(msg.compute_s, 4), decode_rows=msg.decode_rows,
                      prefill_tokens=msg.prefill_tokens, bytes_streamed=msg.bytes_streamed)

    # -- once per loop ---------------------------------------------------------------------------
    def update(self) -> None:
        run = self.group.current
        if run is not None and run is not self.run:
            self.run, self.running = run, 0
            structlog.contextvars.bind_contextvars(job=run.job.id)
            structlog.contextvars.unbind_contextvars("pass_index")
            mt.build_info(run.model_name, run.kv_format)
            for gauge in (mt.JOB_ESTIMATE, mt.JOB_ESTIMATE_ERROR):
                gauge.hide()   # until this job's figures come
            if run.estimate is not None:
                mt.JOB_ESTIMATE.set(run.estimate.first.total_seconds)
        elif run is None and self.run is not None:
            structlog.contextvars.unbind_contextvars("job", "pass_index")
        if self.group.epoch != self.epoch:   # rows in flight are resubmitted and wait again
            self.epoch, self.running = self.group.epoch, 0
        if self.run is None:
            return
        counts, live = self.run.job.counts(), self.group.current is not None   # an ended job has no rows in flight
        running = min(self.running, len(self.run.pending)) if live else 0
        waiting = len(self.run.pending) - running if live else 0
        for state, n in (("waiting", waiting), ("running", running),
                         ("done", counts["succeeded"]), ("failed", counts["failed"])):
            mt.JOB_ROWS.labels(state).set(n)
        eta = self.run.live_eta() if live else 0.0
        if eta is None:
            return
        mt.JOB_ETA.set(eta)
        estimate = self.run.estimate.first.total_seconds if self.run.estimate is not None else 0.0
        if estimate > 0 and self.run.passes:   # an ended job: its actual time over the estimate
            taken = self.run.actual_seconds(time.monotonic() if live else None)
            mt.JOB_ESTIMATE_ERROR.set((taken + eta) / estimate - 1)

    def linger(self) -> None:
        """Where a Prometheus scrapes us, wait (one scrape interval at most) for it to see the end."""
        if self.server is None or not self.clock.times:
            return
        self.update()
        interval = self.clock.interval() or ONE_SCRAPE_S   # scraped once: the interval is not known yet
        deadline, seen = time.monotonic() + min(interval * 1.5, 60.0), self.clock.times[-1]
        while time.monotonic() < deadline and self.clock.times[-1] == seen:
            time.sleep(0.05)
        time.sleep(0.25)   # the scrape that saw the end is still being answered
        self.server.shutdown()


ONE_SCRAPE_S = 15.0   # how long to wait for a second scrape when only one was seen (a common interval)


def _memory(msg: m.Pass) -> None:
    """Memory figures of the PASS report (the cgroup's usage only where a memory cgroup holds us)."""
    live = {"mlx_active": msg.active_memory, "mlx_cache": msg.cache_memory, "reader_buffers": msg.reader_memory}
    for kind, n in live.items():
        if n:
            mt.LIVE.labels(kind).set(n)
    mt.MLX_PEAK.set(msg.peak_memory)
    if msg.read_bandwidth:
        mt.READ_BANDWIDTH.set(msg.read_bandwidth)
    if msg.cgroup_usage is not None:
        mt.CGROUP_USAGE.set(msg.cgroup_usage)
    mt.PASS_FAULTS.labels("minor").inc(msg.minor_faults)
    mt.PASS_FAULTS.labels("major").inc(msg.major_faults)


def _budget(msg: m.Budget) -> None:
    """Admission's report after a pass: its memory lines, a hold, the rows it queued again."""
    for gauge, n in ((mt.WORKING_SET, msg.working_set), (mt.BUDGET, msg.budget), (mt.GUARD, msg.guard),
                     (mt.HARD, msg.hard)):
        gauge.set(n)
    mt.LIVE.labels("other_processes").set(msg.others)
    if msg.probe_bandwidth:
        mt.PROBE_BANDWIDTH.set(msg.probe_bandwidth)
    mt.HOLDS.inc(1 if msg.held_rows else 0)
    mt.PREEMPTIONS.inc(msg.preempted_rows)


def metrics_args(host: str | None, port: int | None) -> dict:
    """`spill up --metrics-host/--metrics-port`, checked when given: the coordinator's arguments (the group reads
    what is not given from SPILL_METRICS_HOST/PORT). The default port, when taken, costs a warning in its log."""
    if port is None and host is None:
        return {}
    if port is not None and not 0 <= port <= 65535:
        raise SpillError(f"--metrics-port {port} is not a port; give 1-65535, or 0 to serve no metrics")
    host = host or config.metrics_host()
    port = config.metrics_port() if port is None else port
    if port and not _free(host, port):
        raise SpillError(f"cannot serve metrics on {host}:{port}: the address is in use or not this machine's "
                         f"(a spill group already up? see `spill status`); choose another with --metrics-port")
    return {"metrics_host": host, "metrics_port": port}


def _free(host: str, port: int) -> bool:
    try:
        with socket.create_server((host, port)):
            return True
    except OSError:
        return False
