"""The Grafana dashboard and the recording rules of its derived queries, generated from one list.

    python grafana/dashboard.py           # writes grafana/spill-dashboard.json and grafana/spill-rules.yml
    python grafana/dashboard.py --check   # fails when a query names a metric spill/metrics.py does not
                                          # define, or when the files differ from what this writes
    python grafana/dashboard.py --markdown  # docs/observability.md's table of panels and their queries
"""

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DASHBOARD, RULES = HERE / "spill-dashboard.json", HERE / "spill-rules.yml"
W = "$__rate_interval"   # Grafana's window for rate(); the recording rules use RULE_WINDOW
RULE_WINDOW = "5m"

# Derived queries: a recording rule each (tested with `promtool test rules`), the same text in the panels.
DERIVED = {
    "spill:job_percent_done": '100 * sum(spill_job_rows{state=~"done|failed"}) / sum(spill_job_rows)',
    "spill:job_eta_seconds:row_rate": f'sum(spill_job_rows{{state=~"waiting|running"}}) '
                                      f'/ sum(rate(spill_rows_completed_total[{W}]))',
    "spill:pass_stream_bytes_per_second": f"sum(rate(spill_streamed_bytes_total[{W}])) "
                                          f"/ sum(rate(spill_pass_duration_seconds_sum[{W}]))",
    "spill:pass_bandwidth_over_probe:ratio": f"sum(rate(spill_streamed_bytes_total[{W}])) "
                                             f"/ sum(rate(spill_pass_duration_seconds_sum[{W}])) "
                                             f"/ sum(spill_read_probe_bytes_per_second)",
}


def q(expr: str, legend: str = "") -> tuple[str, str]:
    return DERIVED.get(expr, expr), legend


def quantile(p: float, histogram: str, by: str = "") -> str:
    return f"histogram_quantile({p}, sum by (le{by}) (rate({histogram}_bucket[{W}])))"


# Rows of the dashboard: (row title, [(panel title, unit, [(query, legend), ...]), ...]).
ROWS = [
    ("Job", [
        ("Progress", "percent", [q("spill:job_percent_done", "done")]),
        ("Rows by state", "short", [q("spill_job_rows", "{{state}}")]),
        ("ETA against the estimate", "s", [q("spill_job_eta_seconds", "live ETA"),
                                           q("spill:job_eta_seconds:row_rate", "rows left / row rate"),
                                           q("spill_job_estimate_seconds", "pre-run estimate")]),
        ("Estimate error", "percentunit", [q("spill_job_estimate_error_ratio", "(elapsed + ETA) / estimate - 1")]),
        ("Rows per hour", "short", [q(f"3600 * sum(rate(spill_rows_completed_total[{W}]))", "rows/h")]),
        ("Tokens per second", "short", [q(f"rate(spill_generated_tokens_total[{W}])", "generated"),
                                        q(f"rate(spill_prompt_tokens_total[{W}])", "prompt")]),
        ("Build", "short", [q("spill_build_info", "{{version}} {{backend}} {{model}} {{kv}}")]),
    ]),
    ("Passes", [
        ("Pass duration", "s", [q(quantile(0.5, "spill_pass_duration_seconds"), "median"),
                                q(quantile(0.9, "spill_pass_duration_seconds"), "p90"),
                                q(f"rate(spill_pass_duration_seconds_sum[{W}]) "
                                  f"/ rate(spill_pass_duration_seconds_count[{W}])", "mean")]),
        ("Pass time by phase", "percentunit", [q(f"sum by (phase) (rate(spill_pass_phase_seconds_total[{W}])) "
                                                 f"/ ignoring(phase) group_left "
                                                 f"sum(rate(spill_pass_duration_seconds_sum[{W}]))", "{{phase}}")]),
        ("Read bandwidth against the probe", "Bps", [q("spill:pass_stream_bytes_per_second", "streamed / pass time"),
                                                     q("spill_pass_read_bandwidth_bytes_per_second", "read, last pass"),
                                                     q("spill_read_probe_bytes_per_second", "probe")]),
        ("Bandwidth over probe", "percentunit", [q("spill:pass_bandwidth_over_probe:ratio", "streamed / probe")]),
        ("Batch and prefill per pass", "short", [
            q(f"rate(spill_pass_decode_rows_total[{W}]) / rate(spill_pass_duration_seconds_count[{W}])", "decode rows"),
            q(f"rate(spill_pass_prefill_tokens_total[{W}]) / rate(spill_pass_duration_seconds_count[{W}])",
              "prefill tokens"),
            q(f'sum(rate(spill_draft_tokens_total{{outcome="accepted"}}[{W}])) '
              f'/ sum(rate(spill_pass_duration_seconds_count[{W}]))', "drafts accepted")]),
    ]),
    ("Memory", [
        ("Live against the budget", "bytes", [q("sum(spill_memory_live_bytes)", "live"),
                                              q("spill_memory_budget_bytes", "budget"),
                                              q("spill_memory_guard_bytes", "guard"),
                                              q("spill_memory_hard_bytes", "hard"),
                                              q("spill_memory_working_set_bytes", "working set"),
                                              q("spill_memory_cgroup_usage_bytes", "cgroup usage"),
                                              q("spill_mlx_peak_bytes", "MLX peak")]),
        ("Live by kind", "bytes", [q("spill_memory_live_bytes", "{{kind}}")]),
        ("Page faults", "short", [q(f"sum by (actor, kind) (rate(spill_process_page_faults_total[{W}]))",
                                    "{{actor}} {{kind}} per s"),
                                  q(f"sum by (kind) (rate(spill_pass_page_faults_total[{W}])) / ignoring(kind) "
                                    f"group_left sum(rate(spill_pass_duration_seconds_count[{W}]))",
                                    "streamer {{kind}} per pass")]),
        ("Holds and preemptions", "short", [q(f"increase(spill_admission_holds_total[{W}])", "passes held"),
                                            q(f"increase(spill_preemptions_total[{W}])", "rows preempted")]),
    ]),
    ("Rows", [
        ("Latency by tier", "s", [q(quantile(0.5, "spill_row_latency_seconds", ", tier"), "{{tier}} median"),
                                  q(quantile(0.9, "spill_row_latency_seconds", ", tier"), "{{tier}} p90")]),
        ("Finish reasons", "short", [q("sum by (reason) (spill_rows_completed_total)", "{{reason}}")]),
    ]),
    ("Processes", [
        ("Up", "short", [q("spill_actor_up", "{{actor}}")]),
        ("Restarts", "short", [q("spill_actor_restarts_total", "{{actor}}")]),
        ("Resident memory", "bytes", [q("spill_process_resident_memory_bytes", "{{actor}}")]),
        ("CPU", "percentunit", [q(f"rate(spill_process_cpu_seconds_total[{W}])", "{{actor}}")]),
    ]),
]


def queries() -> list[tuple[str, str, str]]:
    """(row, panel, expr) of every query in the dashboard."""
    return [(row, title, expr) for row, panels in ROWS for title, _unit, targets in panels for expr, _ in targets]


def metric_names(expr: str) -> set[str]:
    """The spill metrics a query reads, histogram series folded into their histogram."""
    return {re.sub(r"_(bucket|sum|count)$", "", n) if re.search(r"_seconds_(bucket|sum|count)$", n) else n
            for n in re.findall(r"\bspill_[a-z0-9_]+", expr)}


def build() -> dict:
    source = {"type": "prometheus", "uid": "${datasource}"}
    panels, y, ident = [], 0, 1
    for row, items in ROWS:
        panels.append({"type": "row", "title": row, "id": ident, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        ident, y = ident + 1, y + 1
        for k, (title, unit, targets) in enumerate(items):
            panels.append({"type": "timeseries", "title": title, "id": ident, "datasource": source,
                           "gridPos": {"h": 8, "w": 8, "x": 8 * (k % 3), "y": y + 8 * (k // 3)},
                           "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                           "targets": [{"refId": chr(65 + i), "datasource": source, "expr": expr,
                                        "legendFormat": legend} for i, (expr, legend) in enumerate(targets)]})
            ident += 1
        y += 8 * ((len(items) + 2) // 3)
    return {"uid": "spill", "title": "spill", "tags": ["spill"], "schemaVersion": 39, "version": 1,
            "editable": True, "refresh": "15s", "time": {"from": "now-6h", "to": "now"},
            "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                     "query": "prometheus", "current": {}, "hide": 0}]},
            "panels": panels}


def rules_yaml() -> str:
    """The derived queries as Prometheus recording rules (YAML; JSON strings are valid YAML scalars)."""
    lines = ["# Generated by grafana/dashboard.py: the dashboard's derived queries as recording rules.",
             "groups:", "  - name: spill-dashboard", "    rules:"]
    for name, expr in DERIVED.items():
        lines += [f"      - record: {name}", f"        expr: {json.dumps(expr.replace(W, RULE_WINDOW))}"]
    return "\n".join(lines) + "\n"


def dashboard_json() -> str:
    return json.dumps(build(), indent=2) + "\n"


def panels_markdown() -> str:
    """docs/observability.md's panel list: row, panel and the query behind each line (kept in step by a test)."""
    lines = ["| row | panel | query |", "| --- | --- | --- |"]
    for row, panel, expr in queries():
        cell = expr.replace("|", "\\|")   # a pipe inside a table cell, code or not
        lines.append(f"| {row} | {panel} | `{cell}` |")
    return "\n".join(lines) + "\n"


def problems() -> list[str]:
    """What --check reports: queries on undefined metrics, files out of date."""
    from spill.metrics import defined_names
    defined, out = defined_names(), []
    for row, panel, expr in queries():
        for name in sorted(metric_names(expr) - defined):
            out.append(f"panel '{panel}' ({row}) queries {name}, which spill/metrics.py does not define")
    for path, text in ((DASHBOARD, dashboard_json()), (RULES, rules_yaml())):
        if not path.is_file() or path.read_text() != text:
            out.append(f"{path.name} is not what grafana/dashboard.py generates; run `python grafana/dashboard.py`")
    return out


def main(argv: list[str]) -> int:
    if "--markdown" in argv:
        print(panels_markdown(), end="")
        return 0
    if "--check" in argv:
        found = problems()
        for line in found:
            print(f"grafana: {line}", file=sys.stderr)
        return 1 if found else 0
    DASHBOARD.write_text(dashboard_json())
    RULES.write_text(rules_yaml())
    print(f"wrote {DASHBOARD} and {RULES}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
