"""The Prometheus alert rules and the Grafana dashboard in deploy/, checked against promtool and
against the metrics a running server exports.

- `promtool check rules` on the alert rules, and `promtool test rules` on their cases;
- every dashboard expression parses as PromQL (promtool checks it as a recording rule);
- every metric and label named by a dashboard panel or an alert is one a running `kvpages serve`
  (`$KVPAGES_BIN`, with a data directory, after saves and lookups) exports;
- the dashboard has a panel for each figure an operator needs.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy/prometheus/kvpages-alerts.yml"
ALERT_TESTS = REPO / "deploy/prometheus/kvpages-alerts.test.yml"
DASHBOARD = REPO / "deploy/grafana/kvpages-dashboard.json"
# Labels Prometheus adds itself, and the histogram bucket label.
OWN_LABELS = {"instance", "job", "le"}
# Series Prometheus makes itself.
PROMETHEUS_SERIES = {"up"}
PROMQL_WORDS = {
    "sum", "by", "rate", "increase", "histogram_quantile", "or", "and", "unless", "without", "max", "min",
    "avg", "count", "topk", "on", "ignoring", "group_left", "group_right", "bool", "offset",
}


def promtool() -> str:
    path = shutil.which("promtool")
    if not path:
        pytest.fail("promtool not found: install Debian's prometheus package (cargo xtask test does)", pytrace=False)
    return path


def test_the_alert_rules_pass_promtool_check_rules():
    out = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 8 rules found" in out.stdout


def test_each_alert_fires_when_it_should_and_not_otherwise():
    out = subprocess.run([promtool(), "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", ALERT_TESTS.read_text()))
    defined = set(re.findall(r"- alert: (\w+)", ALERTS.read_text()))
    assert tested == defined, f"alerts without a test case: {defined - tested}"


def dashboard_exprs():
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def alert_exprs():
    text = ALERTS.read_text()
    # Each `expr:` is a one-line value or a folded block (`>-`) of the more-indented lines below it.
    exprs, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(\s*)expr: (.*)", line)
        if not m:
            continue
        if m.group(2).strip() != ">-":
            exprs.append(m.group(2))
            continue
        indent, body = len(m.group(1)), []
        for nxt in lines[i + 1 :]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            body.append(nxt.strip())
        exprs.append(" ".join(b for b in body if b and not b.startswith("#")))
    return exprs


def grafana_to_promql(expr: str) -> str:
    return expr.replace("$__rate_interval", "5m").replace("$instance", ".*")


def test_every_dashboard_expression_is_valid_promql():
    exprs = dashboard_exprs()
    assert len(exprs) >= 16
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:panel_{i}", "expr": grafana_to_promql(e)} for i, (_, e) in enumerate(exprs)
    ]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
        json.dump(rules, f)  # JSON is YAML
        f.flush()
        out = subprocess.run([promtool(), "check", "rules", f.name], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def exported():
    """{metric name: set of label names} of a server that has saved, looked up and fsynced."""
    binary = os.environ.get("KVPAGES_BIN", str(REPO / "target/debug/kvpages"))
    with tempfile.TemporaryDirectory() as data, tempfile.TemporaryFile("w+") as log:
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "serve", "--port", str(port), "--data-dir", data], stdout=log, stderr=subprocess.STDOUT
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if requests.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
                time.sleep(0.2)
            key = "ab" * 16
            assert requests.post(f"{url}/rank/0/initialize", json={"num_pages": 4, "role": "worker"}).ok
            assert requests.post(f"{url}/keys/batch_allocate", json={"rank": 0, "keys": [[key, ""]]}).ok
            confirm = {"rank": 0, "confirmations": [[key, 0]], "pages_to_release": []}
            assert requests.post(f"{url}/keys/confirm_write", json=confirm).status_code == 204
            assert requests.post(f"{url}/keys/get_locations", json={"rank": 0, "keys": [key]}).ok
            assert requests.post(f"{url}/keys/batch_exists", json={"keys": [key]}).ok
            assert requests.post(f"{url}/keys/batch_exists", json={"keys": 1}).status_code == 400
            # An SGLang pool too, for the labels only its series carry (rank, namespace).
            assert requests.post(f"{url}/0/initialize", json={"num_pages": 4, "namespace": "kv"}).status_code == 204
            assert requests.post(f"{url}/0/exists", json={"keys": [key], "namespace": "kv"}).ok
            text = requests.get(f"{url}/metrics").text
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    metrics = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        # A label value may hold braces (route="/rank/{rank}/initialize"): the labels run to the
        # last brace before the sample.
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+\S+$", line)
        assert m, line
        labels = set(re.findall(r'([a-zA-Z_]\w*)="(?:[^"\\]|\\.)*"', m.group(3) or ""))
        metrics.setdefault(m.group(1), set()).update(labels)
    return metrics


def names_in(expr: str):
    """Metric names and the label names an expression uses (selectors, `by (...)`)."""
    stripped = re.sub(r'"[^"]*"', '""', expr)
    labels = set(re.findall(r"(\w+)\s*(?:=~|!=|!~|=)\s*\"", stripped))
    for group in re.findall(r"\bby\s*\(([^)]*)\)", stripped):
        labels.update(g.strip() for g in group.split(",") if g.strip())
    idents = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b", re.sub(r"\{[^}]*\}|\bby\s*\([^)]*\)|\[[^\]]*\]", "", stripped)))
    metrics = {i for i in idents if i not in PROMQL_WORDS and not i.isdigit() and not i.startswith("__")}
    return metrics, labels


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_and_label_named_is_one_the_server_exports(exported, source):
    exprs = [e for _, e in dashboard_exprs()] if source == "dashboard" else alert_exprs()
    assert exprs
    for expr in exprs:
        metrics, labels = names_in(grafana_to_promql(expr))
        assert metrics, expr
        missing = {m for m in metrics if m not in exported and m not in PROMETHEUS_SERIES}
        assert not missing, f"{source}: {expr}\n  names metrics the server does not export: {missing}"
        have = set(OWN_LABELS)
        for m in metrics:
            have |= exported.get(m, set())
        unknown = labels - have
        assert not unknown, f"{source}: {expr}\n  uses labels none of {metrics} has: {unknown}"


def test_the_dashboard_shows_what_an_operator_needs():
    used = set()
    for _, expr in dashboard_exprs():
        used |= names_in(grafana_to_promql(expr))[0]
    needed = {
        "kvpages_http_requests_total",  # requests and errors by route
        "kvpages_http_request_duration_seconds_bucket",  # p50/p99 by route
        "kvpages_pages", "kvpages_pool_pages",  # pages by state per rank
        "kvpages_location_hits_total", "kvpages_location_misses_total",  # hit rate
        "kvpages_evictions_total", "kvpages_expired_reservations_total", "kvpages_refused_confirms_total",
        "kvpages_log_fsync_duration_seconds_bucket", "kvpages_log_bytes",
        "kvpages_plugin_traps_total", "kvpages_plugin_faults_total",
        "kvpages_storage_up", "kvpages_engine_up",
    }
    assert needed <= used, f"no panel for {needed - used}"
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert len(titles) == len(set(titles)), "two panels share a title"
