"""The monitoring profile (docker-compose.yml, deploy/): the Grafana dashboard, the
Prometheus alert rules and scrape config, Alertmanager's routes, and what they query.

Every PromQL expression of the dashboard and the rules is read by a small extractor
that names the series it selects (and fails on anything it does not understand); each
name must be one the worker or the status exporter (`pipeline status --serve`)
exports, as prometheus_client writes it: a counter `x` as `x_total`, a histogram `x`
as `x_bucket`, `x_sum` and `x_count`. The unit tests check that against a fresh
WorkerMetrics registry and an exporter fed one report; the integration test against a
running worker's /metrics, after it embedded and committed real records
(tests/test_status_exporter.py: against a running exporter's).

promtool and amtool run the rules' unit tests and check Alertmanager's routes: from
$PROMTOOL and $AMTOOL, else as scripts/prom-tools.sh builds them (scripts/test.sh
does, once), else from PATH; without them those tests skip, saying so.

(PyYAML, for the YAML files, comes with transformers, a dependency of the project.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.core.metrics import LagClock, WorkerMetrics
from pipeline.status.exporter import StatusCollector
from tests.helpers import publish_json, publish_raw, start_worker, stop
from tests.test_metrics import Samples, free_port, series, value

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pipeline.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "pipeline.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
ALERTMANAGER = DEPLOY / "alertmanager" / "alertmanager.yml"
RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
COMPOSE = REPO / "docker-compose.yml"

WORKER_SERVICES = ("worker", "worker-gpu", "worker-s3")
METRICS_PORT = 9400
EXPORTER_SERVICE, EXPORTER_JOB, EXPORTER_PORT = "status-exporter", "pipeline-status", 9401
MONITORING_SERVICES = ("prometheus", "grafana", "alertmanager", EXPORTER_SERVICE)
# Series Prometheus makes itself for every target, not exported by the worker.
PROMETHEUS_SERIES = {"up"}
EXPECTED_ALERTS = {
    "embedding-pipeline-partitions": {
        "PartitionStalled",
        "PartitionLagSecondsHigh",
        "PartitionLagGrowing",
    },
    "embedding-pipeline-workers": {
        "NoWorkerUp",
        "WorkerDown",
        "WorkerNotCommitting",
        "WorkerRestarting",
        "DeadLetters",
    },
    "embedding-pipeline-groups": {
        "ConsumerGroupStopped",
        "ConsumerGroupNotCommitting",
        "StatusExporterDown",
        "StatusExporterCannotReadBroker",
    },
}
# What the dashboard must show (issue 30); each name must be queried by some panel.
REQUIRED_SERIES = {
    "pipeline_partition_lag",
    "pipeline_partition_lag_seconds",
    "pipeline_records_total",
    "pipeline_batch_latency_seconds_bucket",
    "pipeline_embed_seconds_bucket",
    "pipeline_batches_in_flight",
    "pipeline_cache_hits_total",
    "pipeline_cache_misses_total",
    "pipeline_dead_letter_records_total",
    "process_resident_memory_bytes",
    # The broker's view, which outlives the workers (issue 33).
    "pipeline_status_lag",
    "pipeline_status_committed_offset",
    "pipeline_status_end_offset",
    "pipeline_status_verdict",
    "pipeline_status_up",
}


# -- the extractor -------------------------------------------------------------------

AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
}  # fmt: skip
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh",
    "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh",
    "count_over_time", "day_of_month", "day_of_week", "day_of_year", "days_in_month", "deg",
    "delta", "deriv", "double_exponential_smoothing", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev",
    "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta", "increase",
    "irate", "label_join", "label_replace", "last_over_time", "ln", "log10", "log2",
    "mad_over_time", "max_over_time", "min_over_time", "minute", "month", "pi",
    "predict_linear", "present_over_time", "quantile_over_time", "rad", "rate", "resets",
    "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc",
    "sort_desc", "sqrt", "stddev_over_time", "stdvar_over_time", "sum_over_time", "tan",
    "tanh", "time", "timestamp", "vector", "year",
}  # fmt: skip
BINARY_KEYWORDS = {"and", "or", "unless", "bool"}
# Followed by a parenthesised list of label names.
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
LITERALS = {"inf", "nan"}

_DURATION = r"(?:\d+(?:ms|[smhdwy]))+|\$\{?__\w+\}?|\$\w+"
_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
  | (?P<matchers>\{(?:[^{}"'`]|"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)*\})
  | (?P<range>\[[^\[\]]*\])
  | (?P<number>(?:0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?![A-Za-z_]))
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>==|!=|>=|<=|[-+*/%^<>(),@])
    """,
    re.VERBOSE,
)
_STRING = r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'
_MATCHER = rf"\s*[A-Za-z_]\w*\s*(?:=~|!~|!=|=)\s*(?:{_STRING})\s*"
_MATCHERS = re.compile(rf"\{{(?:{_MATCHER}(?:,{_MATCHER})*,?\s*)?\}}")
_RANGE = re.compile(rf"\[\s*(?:{_DURATION})\s*(?::\s*(?:{_DURATION})?\s*)?\]")
_LABEL_VALUES = re.compile(r"label_values\(\s*(?:([A-Za-z_:][\w:]*)\s*,\s*)?[A-Za-z_]\w*\s*\)")


class PromQLError(ValueError):
    """An expression the extractor does not understand: fix it or teach the extractor."""


def _tokens(expr: str) -> Iterator[tuple[str, str]]:
    pos = 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise PromQLError(f"cannot read {expr[pos : pos + 20]!r} in {expr!r}")
        pos = match.end()
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            yield kind, match.group()


def selected_series(expr: str) -> set[str]:
    """The metric names a PromQL expression selects. Raises PromQLError on anything it
    cannot account for: an unknown function, a selector without a metric name (or one
    by __name__), a Grafana variable outside label matchers and ranges, unbalanced
    parentheses, a malformed label list."""
    tokens = list(_tokens(expr))
    names: set[str] = set()
    depth = 0
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        after = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if kind == "matchers":
            if not _MATCHERS.fullmatch(text):
                raise PromQLError(f"malformed label matchers {text} in {expr!r}")
            raise PromQLError(f"a selector without a metric name ({text}) in {expr!r}")
        if kind == "range" and not _RANGE.fullmatch(text):
            raise PromQLError(f"malformed range {text} in {expr!r}")
        if kind == "op":
            depth += {"(": 1, ")": -1}.get(text, 0)
            if depth < 0:
                raise PromQLError(f"unbalanced parentheses in {expr!r}")
        if kind != "ident":
            i += 1
            continue
        if text in GROUPING:
            if after != ("op", "("):
                if text in {"group_left", "group_right"}:
                    i += 1
                    continue
                raise PromQLError(f"{text} without a label list in {expr!r}")
            close = next((j for j in range(i + 2, len(tokens)) if tokens[j] == ("op", ")")), None)
            labels = tokens[i + 2 : close]
            if close is None or any(t != ("op", ",") and t[0] != "ident" for t in labels):
                raise PromQLError(f"malformed label list after {text} in {expr!r}")
            i = close + 1
            continue
        if text in BINARY_KEYWORDS or text in LITERALS:
            i += 1
            continue
        if text == "offset":
            if after[0] != "duration":
                raise PromQLError(f"offset without a duration in {expr!r}")
            i += 2
            continue
        if after == ("op", "("):
            if text not in FUNCTIONS | AGGREGATIONS:
                raise PromQLError(f"unknown function {text}() in {expr!r}")
            i += 1
            continue
        if text in AGGREGATIONS and after[1] in {"by", "without"}:
            i += 1
            continue
        # A metric name: a selector, with or without matchers and a range.
        names.add(text)
        i += 1
        if i < len(tokens) and tokens[i][0] == "matchers":
            matchers = tokens[i][1]
            if not _MATCHERS.fullmatch(matchers) or "__name__" in matchers:
                raise PromQLError(f"label matchers {matchers} not understood in {expr!r}")
            i += 1
    if depth:
        raise PromQLError(f"unbalanced parentheses in {expr!r}")
    if not names:
        raise PromQLError(f"no metric selected by {expr!r}")
    return names


def variable_series(query: str) -> set[str]:
    """The metric a Grafana template variable's label_values(metric, label) reads."""
    match = _LABEL_VALUES.fullmatch(query.strip())
    if match is None or match.group(1) is None:
        raise PromQLError(f"template query not understood: {query!r}")
    return {match.group(1)}


def exported_series(families: Iterator[Any]) -> set[str]:
    """The series names a registry's families give Prometheus, whether or not they have
    a sample yet (a labelled metric has none until a label set is used)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
    }
    names: set[str] = set()
    for family in families:
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


# -- the files -----------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(RULES)["groups"] for rule in group["rules"]]


def queries() -> dict[str, set[str]]:
    """Every query of the dashboard and the rules, by where it is, with what it selects."""
    found: dict[str, set[str]] = {}
    board = dashboard()
    for panel in board["panels"]:
        for target in panel["targets"]:
            found[f"panel {panel['title']!r} {target['refId']}"] = selected_series(target["expr"])
    for variable in board["templating"]["list"]:
        found[f"variable {variable['name']}"] = variable_series(variable["query"]["query"])
    for rule in rules():
        found[f"alert {rule['alert']}"] = selected_series(rule["expr"])
    return found


def missing(exported: set[str]) -> dict[str, list[str]]:
    return {
        where: sorted(names - exported - PROMETHEUS_SERIES)
        for where, names in queries().items()
        if names - exported - PROMETHEUS_SERIES
    }


# -- unit tests ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('sum by (job) (rate(pipeline_records_total{job=~"$job"}[$__rate_interval]))',
         {"pipeline_records_total"}),
        ("histogram_quantile(0.95, sum by (le) (rate(pipeline_embed_seconds_bucket[5m])))",
         {"pipeline_embed_seconds_bucket"}),
        ("pipeline_partition_lag > 0 and on (instance, topic, partition) "
         "changes(pipeline_committed_offset[10m]) == 0 unless on (instance, tier) "
         'label_replace(pipeline_backfill_waiting == 1, "tier", "backfill", "", "")',
         {"pipeline_partition_lag", "pipeline_committed_offset", "pipeline_backfill_waiting"}),
        ('absent(up{job=~"worker|worker-gpu"} == 1)', {"up"}),
        ("max(x) by (a) / on(a) group_left(b) y offset 5m", {"x", "y"}),
        ('label_replace(m{a="}"}, "dst", "$1", "src", "(.*)") * 1e3', {"m"}),
        ("rate(m[5m:1m])", {"m"}),
    ],
)  # fmt: skip
def test_the_extractor_names_the_selected_series(expr: str, names: set[str]) -> None:
    assert selected_series(expr) == names


@pytest.mark.parametrize(
    "expr",
    [
        '{__name__="pipeline_records_total"}',  # no metric name to check
        'pipeline_records_total{__name__=~".+"}',
        "rates(pipeline_records_total[5m])",  # not a function
        "sum(rate(pipeline_records_total[5m])",  # unbalanced
        "rate(pipeline_records_total[$__rate_interval)",
        "pipeline_records_total / $scale",  # a Grafana variable outside matchers
        "sum by job (pipeline_records_total)",
        "1 + 2",  # selects nothing
        "pipeline_records_total{job=}",
    ],
)
def test_the_extractor_fails_on_what_it_cannot_read(expr: str) -> None:
    with pytest.raises(PromQLError):
        selected_series(expr)


def exporter_series() -> set[str]:
    """What the status exporter serves once it has read one report (a read with every
    field known, so that every family has a sample)."""
    collector = StatusCollector("g")
    row = {"topic": "t", "partition": 0, "tier": "nearline", "committed": 5, "end": 9}
    report = {
        "verdict": "LAGGING",
        "members": [],
        "dead_letter": {"topic": "t.dlq", "records": 0},
        "partitions": [{**row, "lag": 4, "lag_seconds": 1.5}],
    }
    collector.update(report, read_seconds=0.1, at=1.0)
    collector.failed(ConnectionError("down"), read_seconds=0.1)  # the error counter
    collector.update(report, read_seconds=0.1, at=2.0)
    return exported_series(collector.collect())


def test_every_query_selects_series_a_worker_registry_declares() -> None:
    text = generate_latest(WorkerMetrics().registry).decode()
    exported = exported_series(text_string_to_metric_families(text))
    assert "process_resident_memory_bytes" in exported
    assert not missing(exported | exporter_series())
    queried = set().union(*queries().values())
    assert queried >= REQUIRED_SERIES, REQUIRED_SERIES - queried


def test_the_dashboard_is_a_provisionable_grafana_dashboard() -> None:
    board = dashboard()
    sources = load_yaml(DATASOURCES)
    assert sources["apiVersion"] == 1
    prometheus = [d for d in sources["datasources"] if d["type"] == "prometheus"]
    assert len(prometheus) == 1 and prometheus[0]["url"] == "http://prometheus:9090"
    uid = prometheus[0]["uid"]

    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    panels = board["panels"]
    assert panels and len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        where = panel["title"]
        assert panel["type"] in {"timeseries", "stat"}, where
        assert panel["description"].endswith("?"), f"{where}: say what it answers"
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, where
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, where
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets), where
        for target in targets:
            assert target["expr"].strip(), where
            assert target["datasource"]["uid"] == uid, where
    for variable in board["templating"]["list"]:
        assert variable["datasource"]["uid"] == uid

    providers = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert [p["type"] for p in providers] == ["file"]
    grafana = load_yaml(COMPOSE)["services"]["grafana"]
    mounts = dict(v.removesuffix(":ro").split(":") for v in grafana["volumes"] if v[0] == ".")
    assert mounts["./deploy/grafana/dashboards"] == providers[0]["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{providers[0]['options']['path']}/{DASHBOARD.name}"


def test_the_rules_parse_into_the_expected_groups() -> None:
    groups = load_yaml(RULES)["groups"]
    assert {g["name"]: {r["alert"] for r in g["rules"]} for g in groups} == EXPECTED_ALERTS
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"(?:\d+[smh])+", rule["for"]), rule["alert"]
    # promtool's unit tests of the rules (alerts_test.yml) reach every alert.
    tests = load_yaml(RULE_TESTS)
    assert tests["rule_files"] == [RULES.name]
    tested = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]}
    assert tested == set().union(*EXPECTED_ALERTS.values())


def prom_tool(name: str, image: str) -> str | None:
    """promtool or amtool: $PROMTOOL / $AMTOOL, else the one scripts/prom-tools.sh
    built for the version of the compose `image`, else one on PATH."""
    if os.environ.get(name.upper()):
        return os.environ[name.upper()]
    tag = load_yaml(COMPOSE)["services"][image]["image"].rpartition(":")[2]
    cache = os.environ.get("PIPELINE_PROM_TOOLS") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        / "embedding-pipeline"
        / "prom-tools"
    )
    built = Path(cache) / f"{name}-{tag}"
    return str(built) if os.access(built, os.X_OK) else shutil.which(name)


PROMTOOL = prom_tool("promtool", "prometheus")
AMTOOL = prom_tool("amtool", "alertmanager")
NOT_BUILT = "{} is not built: run scripts/prom-tools.sh (scripts/test.sh does)"


def run_tool(tool: str, *args: str) -> str:
    done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


@pytest.mark.skipif(PROMTOOL is None, reason=NOT_BUILT.format("promtool"))
def test_promtool_accepts_the_config_the_rules_and_their_unit_tests() -> None:
    assert PROMTOOL is not None
    # --syntax-only: the rule file's path is where compose mounts it, not here.
    run_tool(PROMTOOL, "check", "config", "--syntax-only", str(PROMETHEUS))
    run_tool(PROMTOOL, "check", "rules", str(RULES))
    run_tool(PROMTOOL, "test", "rules", str(RULE_TESTS))


# Where Alertmanager sends what: (labels of an alert, the receiver it reaches).
ROUTES = [
    ({"alertname": "ConsumerGroupStopped", "severity": "critical", "group": "g"}, "oncall"),
    ({"alertname": "NoWorkerUp", "severity": "critical"}, "oncall"),
    ({"alertname": "PartitionLagGrowing", "severity": "warning", "job": "worker"}, "team"),
    ({"alertname": "DeadLetters", "severity": "info", "job": "worker"}, "team"),
]


@pytest.mark.skipif(AMTOOL is None, reason=NOT_BUILT.format("amtool"))
def test_amtool_accepts_the_alertmanager_config_and_routes_each_severity() -> None:
    assert AMTOOL is not None
    run_tool(AMTOOL, "check-config", str(ALERTMANAGER))
    for labels, receiver in ROUTES:
        pairs = [f"{k}={v}" for k, v in labels.items()]
        run_tool(
            AMTOOL, "config", "routes", "test", f"--config.file={ALERTMANAGER}",
            f"--verify.receivers={receiver}", *pairs,
        )  # fmt: skip
    # Every severity the rules use has a route that was tested.
    severities = {rule["labels"]["severity"] for rule in rules()}
    assert severities <= {labels["severity"] for labels, _ in ROUTES}


def test_alertmanager_inhibitions_name_alerts_that_exist() -> None:
    alerts = set().union(*EXPECTED_ALERTS.values())
    for rule in load_yaml(ALERTMANAGER)["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            name = re.fullmatch(r'alertname="(\w+)"', matcher)
            assert name is not None and name.group(1) in alerts, matcher


def test_prometheus_scrapes_every_worker_service_on_its_metrics_port() -> None:
    """The scrape config finds each worker service's replicas by DNS, on the port the
    service's command serves metrics on, and scrapes the status exporter on its
    --serve port; the monitoring tools run in the monitoring profile, Prometheus loads
    the rules file from where it is mounted and sends alerts to Alertmanager."""
    config = load_yaml(PROMETHEUS)
    services = load_yaml(COMPOSE)["services"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {*WORKER_SERVICES, EXPORTER_JOB}
    for name in WORKER_SERVICES:
        assert f"--metrics-port {METRICS_PORT}" in " ".join(services[name]["command"].split())
        [sd] = jobs[name]["dns_sd_configs"]
        assert sd == {**sd, "names": [name], "type": "A", "port": METRICS_PORT}
    exporter = " ".join(services[EXPORTER_SERVICE]["command"].split())
    assert exporter.startswith("status ") and f"--serve :{EXPORTER_PORT}" in exporter
    [static] = jobs[EXPORTER_JOB]["static_configs"]
    assert static["targets"] == [f"{EXPORTER_SERVICE}:{EXPORTER_PORT}"]
    for service in MONITORING_SERVICES:
        assert services[service]["profiles"] == ["monitoring"], service
    prometheus = services["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert config["rule_files"] == [f"/etc/prometheus/{RULES.name}"]
    [alertmanagers] = config["alerting"]["alertmanagers"]
    assert alertmanagers["static_configs"] == [{"targets": ["alertmanager:9093"]}]
    alertmanager = services["alertmanager"]
    assert "./deploy/alertmanager:/etc/alertmanager:ro" in alertmanager["volumes"]
    assert f"--config.file=/etc/alertmanager/{ALERTMANAGER.name}" in alertmanager["command"]
    for service in ("prometheus", "grafana", "alertmanager"):
        assert all(p.startswith("127.0.0.1:") for p in services[service]["ports"]), service
    assert "ports" not in services[EXPORTER_SERVICE]  # inside the network only


def test_lag_seconds_age_the_oldest_uncommitted_record_as_first_seen() -> None:
    clock = LagClock()
    key = ("t", 0)
    assert clock.seconds(key, highwater=10, committed=10, now=100.0) == 0.0
    assert clock.seconds(key, highwater=20, committed=10, now=105.0) == 0.0  # just seen
    assert clock.seconds(key, highwater=30, committed=10, now=110.0) == 5.0
    assert clock.seconds(key, highwater=30, committed=20, now=111.0) == 1.0  # 20..29 from 110
    assert clock.seconds(key, highwater=30, committed=30, now=112.0) == 0.0
    assert clock.seconds(key, highwater=40, committed=30, now=120.0) == 0.0
    assert clock.seconds(key, highwater=40, committed=30, now=150.0) == 30.0  # stalled


def test_lag_clock_thins_out_and_only_ever_underestimates() -> None:
    clock = LagClock(max_entries=8)
    key = ("t", 0)
    for n in range(1, 101):  # a watermark 10 higher every second, nothing committed
        clock.seconds(key, highwater=10 * n, committed=0, now=float(n))
    assert clock.seconds(key, highwater=1000, committed=0, now=100.0) == 99.0  # first kept
    for committed in range(10, 1000, 10):
        seen_at = committed // 10 + 1  # when the record at `committed` was first seen
        assert 0 <= clock.seconds(key, 1000, committed, now=100.0) <= 100 - seen_at


def test_lag_series_follow_the_owned_partitions() -> None:
    metrics = WorkerMetrics()
    get = metrics.registry.get_sample_value
    labels = {"topic": "t", "partition": "1", "tier": "nearline"}
    metrics.set_partition_lag({("t", 0): (50, 40), ("t", 1): (7, 9)}, now=1.0)
    assert get("pipeline_partition_lag", labels) == 0  # a stale watermark: never < 0
    assert get("pipeline_committed_offset", labels) == 9
    metrics.set_partition_lag({("t", 0): (50, 40)}, now=4.0)  # t/1 revoked
    assert get("pipeline_partition_lag", labels) is None
    assert get("pipeline_partition_lag_seconds", labels) is None
    assert get("pipeline_committed_offset", labels) is None
    assert get("pipeline_partition_lag_seconds", {**labels, "partition": "0"}) == 3.0


def test_lag_series_name_each_partitions_tier() -> None:
    """A tiered worker's partitions carry their tier, so that PartitionStalled can leave
    out backfill partitions only while backfill waits, not the nearline ones."""
    metrics = WorkerMetrics()
    metrics.tier_of = lambda key: "backfill" if key[0] == "corpus" else "nearline"
    metrics.set_partition_lag({("live", 0): (5, 3), ("corpus", 0): (90, 10)}, now=1.0)
    text = generate_latest(metrics.registry).decode()
    lag = {
        (s.labels["topic"], s.labels["tier"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "pipeline_partition_lag"
        for s in family.samples
    }
    assert lag == {("live", "nearline"): 2, ("corpus", "backfill"): 80}


def test_a_tiered_worker_labels_its_backfill_partitions(tmp_path: Path) -> None:
    """The tiered flow control hands the worker's metrics its tiers."""
    from kafka import TopicPartition

    from consumers.flow import flow_control
    from consumers.partitions import Ownership, Reader
    from pipeline.core.config import KafkaSettings, WorkerConfig
    from tests.test_tiers import LagConsumer

    config = WorkerConfig.of(("live", "corpus"), "g", tmp_path, backfill_topics=("corpus",))
    consumer = LagConsumer()
    consumer.assigned = {TopicPartition("live", 0), TopicPartition("corpus", 0)}
    reader = Reader(consumer, Ownership(), tmp_path, KafkaSettings())  # type: ignore[arg-type]
    metrics = WorkerMetrics()
    flow = flow_control(config)
    flow.pause(consumer, reader, Ownership().in_flight, metrics)  # type: ignore[arg-type]
    metrics.set_partition_lag({("live", 0): (3, 3), ("corpus", 0): (10, 4)}, now=1.0)
    lag = {
        (labels["topic"], labels["tier"]): value
        for family in metrics.registry.collect()
        if family.name == "pipeline_partition_lag"
        for _, labels, value, *_ in family.samples
    }
    assert lag == {("live", "nearline"): 0, ("corpus", "backfill"): 6}


# -- against a running worker --------------------------------------------------------

GOOD = 60
PARTITIONS = 2
DEADLINE_S = 120


def _fetch(port: int) -> str:
    """The worker's /metrics page; empty while it does not serve yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return ""


def _samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _caught_up(samples: Samples) -> bool:
    lag = series(samples, "pipeline_partition_lag")
    seconds = series(samples, "pipeline_partition_lag_seconds")
    return (
        value(samples, "pipeline_records_total", outcome="embedded") == GOOD
        and value(samples, "pipeline_records_total", outcome="dead_lettered") == 1
        and len(lag) == PARTITIONS
        and not any(lag.values())
        and set(seconds) == set(lag)
        and not any(seconds.values())
    )


@pytest.mark.integration
def test_a_running_worker_exports_every_series_the_dashboard_and_rules_query(
    broker: str,
    make_topic: Callable[..., str],
    group_id: str,
    tiny_model: str,
    tmp_path: Path,
) -> None:
    topic = make_topic(partitions=PARTITIONS)
    records = [{"id": f"d{i}", "text": f"record number {i} of the dashboard"} for i in range(GOOD)]
    publish_json(broker, topic, records, partitions=PARTITIONS)
    publish_raw(broker, topic, [(None, b"not json")], partitions=1)
    port = free_port()
    log = tmp_path / "worker.log"
    proc = start_worker(
        broker, topic, group_id, tmp_path / "out",
        "--model", tiny_model,
        "--metrics-port", str(port),
        "--batch-size", "16",
        "--poll-timeout-ms", "200",
        log=log,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + DEADLINE_S
        text, samples = "", {}
        while not _caught_up(samples):
            assert proc.poll() is None, f"worker exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not caught up: {samples}\n{log.read_text()}"
            time.sleep(0.5)
            text = _fetch(port)
            samples = _samples(text)
    finally:
        code = stop(proc, signal.SIGTERM, timeout=60)
    assert code == 0, log.read_text()[-3000:]

    worker = exported_series(text_string_to_metric_families(text))
    assert not missing(worker | exporter_series())
    # The series the dashboard is for carry values, not only declarations.
    offsets = series(samples, "pipeline_committed_offset")
    assert sorted(offsets) == [
        (("partition", str(p)), ("tier", "nearline"), ("topic", topic)) for p in range(PARTITIONS)
    ]
    assert sum(offsets.values()) == GOOD + 1  # every record, the dead-lettered one too
    assert (value(samples, "process_resident_memory_bytes") or 0) > 10 * 2**20
    assert (value(samples, "pipeline_batch_latency_seconds_count") or 0) >= 1
    assert (value(samples, "pipeline_dead_letter_records_total") or 0) == 1
