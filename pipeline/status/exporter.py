"""`pipeline status --serve`: the status report as Prometheus metrics.

The workers' own lag series vanish with the workers: a dead fleet leaves no series
to alert on. This exporter reads what the broker holds (the group's committed
offsets, the partitions' end offsets, the group's members), as `pipeline status`
does, every few seconds, and serves the last read on /metrics. Each read shares one
deadline (`collect_status`'s timeout); a read that fails (broker unreachable, group
unknown) is `pipeline_status_up 0` and a count by error class, never an exit, and
the partition series go away until a read succeeds again (stale offsets would look
like a stall).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import kafka.errors as kerrors
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.core.config import KafkaSettings
from pipeline.core.errors import ConfigError, PipelineError
from pipeline.status.collect import collect_status
from pipeline.status.history import StatusHistory
from pipeline.status.kafka_reads import DEFAULT_TIMEOUT_S
from pipeline.status.verdicts import VERDICTS

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 15.0
_PARTITION = ["group", "topic", "partition", "tier"]
Collect = Callable[..., dict[str, Any]]


class StatusCollector(Collector):
    """The metrics of one group's last read (`update`) or failed read (`failed`)."""

    def __init__(self, group: str) -> None:
        self.group = group
        self._report: dict[str, Any] | None = None
        self._read_seconds = 0.0
        self._last_success: float | None = None
        self._errors: dict[str, int] = {}
        self._lock = threading.Lock()

    def update(self, report: dict[str, Any], read_seconds: float, at: float) -> None:
        with self._lock:
            self._report, self._read_seconds, self._last_success = report, read_seconds, at

    def failed(self, error: Exception, read_seconds: float) -> None:
        with self._lock:
            self._report, self._read_seconds = None, read_seconds
            name = type(error).__name__
            self._errors[name] = self._errors.get(name, 0) + 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            report, errors = self._report, dict(self._errors)
            read_seconds, last_success = self._read_seconds, self._last_success
        group = [self.group]
        yield _gauge(
            "up",
            "1 when the last read of the broker succeeded, else 0",
            ["group"],
            [(group, 0 if report is None else 1)],
        )
        failures = CounterMetricFamily(
            "pipeline_status_read_errors",
            "Reads of the broker that failed, by error class",
            labels=["group", "error"],
        )
        for name, count in sorted(errors.items()):
            failures.add_metric([self.group, name], count)
        yield failures
        yield _gauge(
            "read_seconds", "How long the last read took", ["group"], [(group, read_seconds)]
        )
        if last_success is not None:
            yield _gauge(
                "last_read_timestamp_seconds",
                "When the last successful read ended",
                ["group"],
                [(group, last_success)],
            )
        if report is not None:
            yield from _report_metrics(self.group, report)


def _gauge(
    name: str, doc: str, labels: list[str], values: Sequence[tuple[list[str], float]]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"pipeline_status_{name}", doc, labels=labels)
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family


def _report_metrics(group: str, report: dict[str, Any]) -> Iterator[Metric]:
    rows = report["partitions"]

    def per_partition(field: str) -> list[tuple[list[str], float]]:
        return [
            ([group, r["topic"], str(r["partition"]), r.get("tier") or ""], r[field])
            for r in rows
            if r[field] is not None
        ]

    yield _gauge(
        "committed_offset",
        "The group's committed offset (absent: none)",
        _PARTITION,
        per_partition("committed"),
    )
    yield _gauge(
        "end_offset",
        "The partition's end offset (last stable offset)",
        _PARTITION,
        per_partition("end"),
    )
    yield _gauge(
        "lag",
        "End offset minus committed offset (the end when none is committed)",
        _PARTITION,
        per_partition("lag"),
    )
    yield _gauge(
        "lag_seconds",
        "Age of the oldest record not yet committed (by its "
        "timestamp); absent when there is none or it could not be read in time",
        _PARTITION,
        per_partition("lag_seconds"),
    )
    yield _gauge(
        "verdict",
        "1 for the group's verdict (pipeline status), 0 for the others",
        ["group", "verdict"],
        [([group, v], int(v == report["verdict"])) for v in VERDICTS],
    )
    yield _gauge(
        "members", "Members of the consumer group", ["group"], [([group], len(report["members"]))]
    )
    dead = report["dead_letter"]
    if dead.get("records") is not None:
        yield _gauge(
            "dead_letter_records",
            "Records in the dead-letter topic",
            ["group", "topic"],
            [([group, dead["topic"]], dead["records"])],
        )


class StatusExporter:
    """Reads the group's status every `interval_s` into a `StatusCollector`."""

    def __init__(
        self,
        kafka: KafkaSettings,
        group: str,
        topics: Sequence[str] | None = None,
        output: Path | None = None,
        *,
        dlq_topic: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        collect: Collect = collect_status,
    ) -> None:
        self.kafka, self.group, self.topics, self.output = kafka, group, topics, output
        self.dlq_topic, self.timeout_s, self._collect = dlq_topic, timeout_s, collect
        self.collector = StatusCollector(group)
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        # Kept between reads: verdicts judge trends (STALLED needs a window).
        self.history = StatusHistory(group=group)
        self._failing = False

    def read(self) -> bool:
        """One read of the broker; whether it succeeded. Expected failures become
        metrics and one log line when they start and when they end."""
        started = time.monotonic()
        try:
            report = self._collect(
                self.kafka,
                self.group,
                self.topics,
                self.output,
                self.history,
                dlq_topic=self.dlq_topic,
                timeout_s=self.timeout_s,
            )
        except (PipelineError, kerrors.KafkaError) as exc:
            self.collector.failed(exc, time.monotonic() - started)
            if not self._failing:
                log.warning("status of group %s: %s (retrying)", self.group, exc)
            self._failing = True
            return False
        self.collector.update(report, time.monotonic() - started, time.time())
        if self._failing:
            log.info("status of group %s: reading the broker again", self.group)
        self._failing = False
        return True

    def run(self, interval_s: float, stop: threading.Event) -> None:
        """Reads every `interval_s` seconds until `stop` is set."""
        while not stop.is_set():
            started = time.monotonic()
            self.read()
            stop.wait(max(0.0, interval_s - (time.monotonic() - started)))


def parse_address(address: str) -> tuple[str, int]:
    """`[HOST]:PORT` or `PORT` -> (host, port); no host means every interface."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--serve {address}: give [HOST]:PORT, e.g. :9401")
    return host, int(port)


def serve(exporter: StatusExporter, address: str, interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """Serves `exporter`'s metrics on `address` and reads every `interval_s` seconds
    until SIGTERM or SIGINT."""
    if interval_s <= 0:
        raise ConfigError("the read interval (--watch) needs a positive number of seconds")
    host, port = parse_address(address)
    try:
        server, _ = start_http_server(port, addr=host, registry=exporter.registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _STOP_SIGNALS}
    log.info(
        "serving the status of group %s on http://%s:%d/metrics, read every %gs",
        exporter.group,
        host,
        port,
        interval_s,
    )
    try:
        exporter.run(interval_s, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.shutdown()
        server.server_close()


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
