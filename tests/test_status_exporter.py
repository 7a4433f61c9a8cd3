"""`pipeline status --serve`: the broker's view of a group as Prometheus metrics, which
outlives the workers (a dead fleet still shows its lag), and whose failed reads are a
gauge, not an exit."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.structs import OffsetAndMetadata
from prometheus_client import generate_latest

from pipeline.core.config import KafkaSettings
from pipeline.core.errors import BrokerUnavailable, ConfigError
from pipeline.status.exporter import StatusExporter, parse_address, serve
from tests.helpers import PIPELINE, REPO, worker_env
from tests.test_dashboard import EXPORTER_JOB, missing
from tests.test_metrics import Samples, free_port, scrape, series, value

DEADLINE_S = 60


def report(verdict: str = "LAGGING", **row: Any) -> dict[str, Any]:
    partition = {"topic": "t", "partition": 0, "tier": None, "committed": 3, "end": 10}
    partition |= {"lag": 7, "lag_seconds": None, **row}
    return {
        "verdict": verdict,
        "members": [{"member_id": "m"}],
        "dead_letter": {"topic": "t.dlq", "records": None},
        "partitions": [partition],
    }


def samples_of(exporter: StatusExporter) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    text = generate_latest(exporter.registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return found


class Reads:
    """A stand-in for collect_status: returns or raises what it is given, in turn."""

    def __init__(self, *outcomes: dict[str, Any] | Exception) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.calls.append((args, kwargs))
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def make_exporter(reads: Reads) -> StatusExporter:
    return StatusExporter(KafkaSettings(bootstrap_servers="x:1"), "g", ["t"], collect=reads)


# -- unit tests ----------------------------------------------------------------------


def test_a_read_exports_offsets_lag_and_the_verdict_by_group() -> None:
    exporter = make_exporter(Reads(report(tier="backfill", lag_seconds=4.5)))
    assert exporter.read() is True
    got = samples_of(exporter)
    labels = (("group", "g"), ("partition", "0"), ("tier", "backfill"), ("topic", "t"))
    assert got["pipeline_status_committed_offset"] == {labels: 3}
    assert got["pipeline_status_end_offset"] == {labels: 10}
    assert got["pipeline_status_lag"] == {labels: 7}
    assert got["pipeline_status_lag_seconds"] == {labels: 4.5}
    verdicts = {dict(k)["verdict"]: v for k, v in got["pipeline_status_verdict"].items()}
    assert verdicts == {"OK": 0, "LAGGING": 1, "STALLED": 0, "STOPPED": 0, "MISMATCH": 0}
    assert got["pipeline_status_members"] == {(("group", "g"),): 1}
    assert got["pipeline_status_up"] == {(("group", "g"),): 1}
    assert "pipeline_status_dead_letter_records" not in got  # no such topic: no figure


def test_unknown_figures_are_left_out_not_exported_as_zero() -> None:
    exporter = make_exporter(Reads(report(committed=None, lag=10, lag_seconds=None)))
    exporter.read()
    got = samples_of(exporter)
    assert "pipeline_status_committed_offset" not in got
    assert "pipeline_status_lag_seconds" not in got
    assert list(got["pipeline_status_lag"].values()) == [10]


def test_a_failed_read_is_up_0_and_counted_and_the_stale_offsets_go(
    caplog: pytest.LogCaptureFixture,
) -> None:
    down = BrokerUnavailable("no broker answered at x:1")
    exporter = make_exporter(Reads(report(), down, down, ConfigError("bad"), report()))
    caplog.set_level(logging.INFO, logger="pipeline.status.exporter")
    assert exporter.read() is True
    assert [exporter.read() for _ in range(3)] == [False, False, False]
    got = samples_of(exporter)
    assert got["pipeline_status_up"] == {(("group", "g"),): 0}
    errors = {dict(k)["error"]: v for k, v in got["pipeline_status_read_errors_total"].items()}
    assert errors == {"BrokerUnavailable": 2, "ConfigError": 1}
    assert "pipeline_status_lag" not in got and "pipeline_status_verdict" not in got
    assert exporter.read() is True
    assert samples_of(exporter)["pipeline_status_up"] == {(("group", "g"),): 1}
    # One line as the failures start, one as they end: not one per read.
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "status of group g: no broker answered at x:1 (retrying)",
        "status of group g: reading the broker again",
    ]


def test_reads_keep_a_history_so_that_verdicts_see_a_trend() -> None:
    reads = Reads(report(), report())
    exporter = make_exporter(reads)
    exporter.read()
    exporter.read()
    for args, kwargs in reads.calls:
        assert args[4] is exporter.history  # the same samples, read after read
        assert kwargs["timeout_s"] > 0  # every read has a deadline


def test_a_bug_is_not_swallowed() -> None:
    exporter = make_exporter(Reads(KeyError("partitions")))
    with pytest.raises(KeyError):
        exporter.read()


@pytest.mark.parametrize(
    ("address", "expected"),
    [(":9401", ("0.0.0.0", 9401)), ("9401", ("0.0.0.0", 9401)),
     ("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:9401", ("::1", 9401))],
)  # fmt: skip
def test_serve_addresses(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["", ":", "host:", ":http", ":0", ":70000"])
def test_a_bad_serve_address_is_a_usage_error(address: str) -> None:
    with pytest.raises(ConfigError, match="--serve"):
        parse_address(address)


def test_a_port_in_use_is_one_line_not_a_traceback() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            serve(make_exporter(Reads()), f"127.0.0.1:{port}", 1.0)


# -- against the real broker ---------------------------------------------------------


def start_exporter(bootstrap: str, group: str, topic: str, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*PIPELINE, "status", "--group", group, "--topic", topic,
         "--serve", f"127.0.0.1:{port}", "--watch", "1"],
        env=worker_env(bootstrap),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def wait_for(proc: subprocess.Popen[bytes], port: int, ready: Callable[[Samples], bool]) -> Samples:
    deadline = time.monotonic() + DEADLINE_S
    samples: Samples = {}
    while not ready(samples):
        assert proc.poll() is None, f"exporter exited {proc.returncode}"
        assert time.monotonic() < deadline, f"not ready: {samples}"
        time.sleep(0.3)
        samples = scrape(port)
    return samples


def stop_exporter(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out.decode()


def partition_values(samples: Samples, name: str) -> dict[tuple[int, str], float]:
    return {
        (int(dict(labels)["partition"]), dict(labels)["tier"]): v
        for labels, v in series(samples, name).items()
    }


def produce(broker: str, topic: str, counts: dict[int, int]) -> None:
    producer = KafkaProducer(bootstrap_servers=broker, acks="all")
    for partition, count in counts.items():
        for i in range(count):
            producer.send(topic, b'{"text": "r%d"}' % i, partition=partition)
    producer.flush(30)
    producer.close()


@pytest.mark.integration
def test_the_exporter_serves_what_the_broker_holds_with_no_worker_running(
    broker: str, make_topic: Callable[..., str], group_id: str
) -> None:
    topic = make_topic(partitions=2)
    produce(broker, topic, {0: 5, 1: 4})
    # A plain kafka-python consumer commits, as a tiered worker would, then leaves.
    consumer = KafkaConsumer(bootstrap_servers=broker, group_id=group_id, enable_auto_commit=False)
    try:
        consumer.commit(
            {
                TopicPartition(topic, 0): OffsetAndMetadata(3, "tier=nearline", -1),
                TopicPartition(topic, 1): OffsetAndMetadata(4, "tier=backfill", -1),
            }
        )
    finally:
        consumer.close(autocommit=False)
    port = free_port()
    proc = start_exporter(broker, group_id, topic, port)
    try:
        samples = wait_for(proc, port, lambda s: bool(series(s, "pipeline_status_lag")))
        assert value(samples, "pipeline_status_up", group=group_id) == 1
        assert partition_values(samples, "pipeline_status_committed_offset") == {
            (0, "nearline"): 3,
            (1, "backfill"): 4,
        }
        assert partition_values(samples, "pipeline_status_end_offset") == {
            (0, "nearline"): 5,
            (1, "backfill"): 4,
        }
        assert partition_values(samples, "pipeline_status_lag") == {
            (0, "nearline"): 2,
            (1, "backfill"): 0,
        }
        # Lag and nobody in the group: the dead fleet's verdict.
        assert value(samples, "pipeline_status_verdict", group=group_id, verdict="STOPPED") == 1
        assert value(samples, "pipeline_status_members", group=group_id) == 0
        lag_seconds = partition_values(samples, "pipeline_status_lag_seconds")
        assert set(lag_seconds) == {(0, "nearline")} and lag_seconds[(0, "nearline")] >= 0
        # Every query of the dashboard and the rules on pipeline_status_* is served.
        served = {name for name, _ in samples}
        exporter_queries = {
            where: names
            for where, names in missing(served).items()
            if any(n.startswith("pipeline_status_") for n in names)
        }
        assert not exporter_queries

        # The broker is read again at each interval: producers go on, commits do not.
        produce(broker, topic, {1: 3})
        samples = wait_for(
            proc,
            port,
            lambda s: partition_values(s, "pipeline_status_lag").get((1, "backfill")) == 3,
        )
        assert partition_values(samples, "pipeline_status_committed_offset")[(1, "backfill")] == 4
    finally:
        code, out = stop_exporter(proc)
    assert code == 0, out
    assert "Traceback" not in out, out


@pytest.mark.integration
def test_an_unreachable_broker_is_a_gauge_not_an_exit(group_id: str) -> None:
    port, dead = free_port(), free_port()  # nothing listens on `dead`
    proc = start_exporter(f"127.0.0.1:{dead}", group_id, "t", port)
    try:
        samples = wait_for(
            proc, port, lambda s: bool(series(s, "pipeline_status_read_errors_total"))
        )
        assert value(samples, "pipeline_status_up", group=group_id) == 0
        errors = series(samples, "pipeline_status_read_errors_total")
        assert [dict(labels)["error"] for labels in errors] == ["BrokerUnavailable"]
        assert not series(samples, "pipeline_status_lag")
        assert proc.poll() is None  # still serving, still retrying
    finally:
        code, out = stop_exporter(proc)
    assert code == 0, out
    assert out.count("WARNING") == 1 and "Traceback" not in out, out


def test_the_prometheus_job_of_the_exporter_is_the_one_the_alerts_name() -> None:
    from tests.test_dashboard import rules

    [down] = [r for r in rules() if r["alert"] == "StatusExporterDown"]
    assert f'job="{EXPORTER_JOB}"' in down["expr"]
