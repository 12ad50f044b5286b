"""The generated dashboard: every query on a defined metric, files up to date, derived queries right."""

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

GRAFANA = Path(__file__).resolve().parents[2] / "grafana"


def load_dashboard():
    spec = importlib.util.spec_from_file_location("spill_dashboard", GRAFANA / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_passes_on_the_checked_in_files():
    dash = load_dashboard()
    assert dash.problems() == []
    board = json.loads((GRAFANA / "spill-dashboard.json").read_text())
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == ["Job", "Passes", "Memory", "Rows", "Processes"]
    assert {t["datasource"]["uid"] for p in board["panels"] for t in p.get("targets", [])} == {"${datasource}"}


def test_check_names_a_panel_that_queries_an_undefined_metric(monkeypatch, capsys):
    dash = load_dashboard()
    monkeypatch.setattr(dash, "ROWS", [("Job", [("Typo", "s", [("rate(spill_pass_secnds_sum[5m])", "")])])])
    monkeypatch.setattr(dash, "DASHBOARD", GRAFANA / "missing.json")
    assert dash.main(["--check"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "grafana: panel 'Typo' (Job) queries spill_pass_secnds_sum, which spill/metrics.py does not define"
    assert err[1] == "grafana: missing.json is not what grafana/dashboard.py generates; run `python grafana/dashboard.py`"


def test_histogram_series_fold_into_their_histogram():
    dash = load_dashboard()
    assert dash.metric_names(dash.quantile(0.9, "spill_row_latency_seconds", ", tier")) == {"spill_row_latency_seconds"}
    assert dash.metric_names("spill_pass_duration_seconds_count / spill_streamed_bytes_total") == {
        "spill_pass_duration_seconds", "spill_streamed_bytes_total"}


RULE_TESTS = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - {{series: 'spill_job_rows{{state="done"}}', values: '0+5x10'}}
      - {{series: 'spill_job_rows{{state="failed"}}', values: '0+1x10'}}
      - {{series: 'spill_job_rows{{state="waiting"}}', values: '130-10x10'}}
      - {{series: 'spill_job_rows{{state="running"}}', values: '10+0x10'}}
      - {{series: 'spill_rows_completed_total{{tier="short",reason="length"}}', values: '0+6x10'}}
      - {{series: 'spill_rows_completed_total{{tier="long",reason="stop"}}', values: '0+6x10'}}
      - {{series: 'spill_streamed_bytes_total', values: '0+6000000000x10'}}
      - {{series: 'spill_pass_duration_seconds_sum', values: '0+30x10'}}
      - {{series: 'spill_read_probe_bytes_per_second', values: '400000000+0x10'}}
    promql_expr_test:
      # 50 done + 10 failed of 100 rows
      - {{expr: 'spill:job_percent_done', eval_time: 10m, exp_samples: [{{labels: 'spill:job_percent_done', value: 60}}]}}
      # 40 rows left at 12 rows a minute
      - {{expr: 'spill:job_eta_seconds:row_rate', eval_time: 10m,
         exp_samples: [{{labels: 'spill:job_eta_seconds:row_rate', value: 200}}]}}
      # 100 MB/s streamed over 0.5 s of pass per second: 200 MB/s in the pass, half the 400 MB/s probe
      - {{expr: 'spill:pass_stream_bytes_per_second', eval_time: 10m,
         exp_samples: [{{labels: 'spill:pass_stream_bytes_per_second', value: 200000000}}]}}
      - {{expr: 'spill:pass_bandwidth_over_probe:ratio', eval_time: 10m,
         exp_samples: [{{labels: 'spill:pass_bandwidth_over_probe:ratio', value: 0.5}}]}}
"""


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is missing: install Debian's prometheus package (.ci/run does)")
def test_promtool_checks_the_derived_queries_on_made_up_series(tmp_path):
    tests = tmp_path / "rules_test.yml"
    tests.write_text(RULE_TESTS.format(rules=json.dumps(str(GRAFANA / "spill-rules.yml"))))
    result = subprocess.run(["promtool", "test", "rules", str(tests)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_observability_doc_lists_every_panel_and_its_query():
    readme = (GRAFANA.parent / "docs" / "observability.md").read_text()
    assert load_dashboard().panels_markdown() in readme
