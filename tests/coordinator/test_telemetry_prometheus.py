"""A real Prometheus scrapes a running group on loopback: every dashboard query has data after a job,
the token counter matches the output, `promtool check metrics` passes, the logs carry the job."""

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from spill import config, memory
from spill.metrics import ONLY_WITH_CGROUP

from ..grafana.test_dashboard import GRAFANA, load_dashboard
from .group_util import read_output, spill, write_input

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                reason="prometheus is missing: install Debian's prometheus package (.ci/run does)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus scraping 127.0.0.1:<metrics port> every second; yields (metrics port, query)."""
    port, web = free_port(), free_port()
    conf = tmp_path / "prometheus.yml"
    conf.write_text(json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                                "rule_files": [str(GRAFANA / "spill-rules.yml")],
                                "scrape_configs": [{"job_name": "spill", "static_configs": [
                                    {"targets": [f"127.0.0.1:{port}"]}]}]}))
    proc = subprocess.Popen(["prometheus", f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{web}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))

    def query(expr: str) -> list:
        url = f"http://127.0.0.1:{web}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        return json.loads(get(url))["data"]["result"]

    try:
        wait_for(lambda: _ready(web))
        wait_for(lambda: query('up{job="spill"}'))   # it scrapes (up 0: no group yet) from before the job starts
        yield port, query
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _ready(web: int) -> bool:
    try:
        return get(f"http://127.0.0.1:{web}/-/ready") is not None
    except OSError:
        return False


def wait_for(check, within_s: float = 60.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {within_s} s")


def test_dashboard_queries_have_data_after_a_job(make_tiny, tmp_path, prometheus):
    port, query = prometheus
    rows = write_input(tmp_path / "in.jsonl", 12, max_tokens=8)
    try:
        spill("up", "--metrics-port", port, check=True)
        wait_for(lambda: query('up{job="spill"} == 1'))
        spill("run", make_tiny("llama"), tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--quiet", check=True)
        scrape = get(f"http://127.0.0.1:{port}/metrics")
        lint = subprocess.run(["promtool", "check", "metrics"], input=scrape, capture_output=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr
        wait_for(lambda: query(f'spill_job_rows{{state="done"}} == {len(rows)}'))
        # queried while the group is up: once its endpoint is gone Prometheus marks its series stale
        out = read_output(tmp_path / "out.jsonl")
        completion = sum(row["response"]["body"]["usage"]["completion_tokens"] for row in out.values())
        assert [float(query("spill_generated_tokens_total")[0]["value"][1])] == [completion]
        dash = load_dashboard()
        empty = []
        no_cgroup = memory.cgroup_usage() is None   # the one series that may be absent: spill/metrics.py
        for row, panel, expr in dash.queries():
            if not query(expr.replace(dash.W, "1m")) and not (no_cgroup and dash.metric_names(expr) == {ONLY_WITH_CGROUP}):
                empty.append(f"{row} / {panel}: {expr}")
        assert empty == [], "\n".join(empty)
    finally:
        spill("down")

    logs = config.home() / "run" / "logs"
    passes = [json.loads(line) for line in (logs / "coordinator.log").read_text().splitlines() if '"pass"' in line]
    assert passes and all(e["actor"] == "coordinator" and e["job"] and "pass_index" in e for e in passes)
    streamer = [json.loads(line) for line in (logs / "streamer.log").read_text().splitlines()]
    assert {e["actor"] for e in streamer} == {"streamer"} and all("pid" in e for e in streamer)


def test_an_embedded_group_stays_up_for_the_scrape_that_sees_its_end(make_tiny, tmp_path, prometheus):
    port, query = prometheus
    write_input(tmp_path / "in.jsonl", 6, max_tokens=4)
    spill("run", make_tiny("llama"), tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "--quiet",
          check=True, env={"SPILL_METRICS_PORT": str(port)})
    # the last scrape's sample may take a moment to be queryable; without the group's linger it never comes
    seen = wait_for(lambda: [float(s["value"][1]) for s in query('max_over_time(spill_job_rows{state="done"}[5m])')
                             if float(s["value"][1]) == 6.0], within_s=10)
    assert seen == [6.0]
