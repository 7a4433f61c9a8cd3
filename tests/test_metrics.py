"""`pipeline run --metrics-port`: a running worker serves Prometheus metrics whose
families exist and whose values agree with what it was fed."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import publish_json, publish_raw, start_worker, stop

pytestmark = pytest.mark.integration

GOOD = 200
BAD_VALUES: list[bytes | None] = [
    b'{"text": "unterminated',
    b'["not", "an", "object"]',
    b'{"id": "no text"}',
    b'{"text": "   "}',
    b"\xff\xfe not utf-8",
]
PARTITIONS = 3
MAX_IN_FLIGHT = 2
DEADLINE_S = 120

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> Samples:
    """Every sample of the endpoint, keyed by (name, sorted labels); {} if not up yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def texts(n: int) -> list[dict[str, str]]:
    """Texts of varied lengths, so batches have something to pad."""
    words = ["the", "pipeline", "embeds", "each", "record", "of", "the", "topic", "exactly", "once"]
    return [
        {"id": f"m{i}", "text": " ".join(words[: 1 + i % len(words)] * (1 + i % 2))}
        for i in range(n)
    ]


def wait_until_done(proc: subprocess.Popen[bytes], port: int, log: Path) -> Samples:
    """Polls the endpoint until every record is accounted for and every lag is 0."""
    deadline = time.monotonic() + DEADLINE_S
    samples: Samples = {}
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"worker exited {proc.returncode}:\n{log.read_text()}"
        samples = scrape(port)
        embedded = value(samples, "pipeline_records_total", outcome="embedded")
        dead = value(samples, "pipeline_records_total", outcome="dead_lettered")
        lag = series(samples, "pipeline_partition_lag")
        caught_up = len(lag) == PARTITIONS and not any(lag.values())
        if embedded == GOOD and dead == len(BAD_VALUES) and caught_up:
            return samples
        time.sleep(0.5)
    progress = {str(k): v for k, v in samples.items() if "records" in k[0] or "lag" in k[0]}
    pytest.fail(
        f"metrics did not reach {GOOD} embedded records and zero lag within {DEADLINE_S}s; "
        f"last: {json.dumps(progress)}\n{log.read_text()[-3000:]}"
    )


def test_metrics_endpoint_reports_a_running_worker(
    broker: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path
) -> None:
    topic = make_topic(partitions=PARTITIONS)
    publish_json(broker, topic, texts(GOOD), partitions=PARTITIONS)
    publish_raw(broker, topic, ((None, v) for v in BAD_VALUES), partitions=PARTITIONS)
    port = free_port()
    log = tmp_path / "worker.log"
    proc = start_worker(
        broker, topic, group_id, tmp_path / "out",
        "--metrics-port", str(port),
        "--batch-size", "32",
        "--poll-timeout-ms", "200",
        "--max-in-flight", str(MAX_IN_FLIGHT),
        log=log,
    )  # fmt: skip
    try:
        samples = wait_until_done(proc, port, log)
    finally:
        code = stop(proc, signal.SIGTERM, timeout=60)
    assert code == 0, log.read_text()[-3000:]

    check_counters(samples)
    check_histograms(samples)
    check_gauges(samples, topic)


def check_counters(samples: Samples) -> None:
    assert value(samples, "pipeline_records_total", outcome="embedded") == GOOD
    assert value(samples, "pipeline_records_total", outcome="dead_lettered") == len(BAD_VALUES)
    assert value(samples, "pipeline_dead_letter_records_total") == len(BAD_VALUES)
    batches = value(samples, "pipeline_batches_total")
    assert batches is not None
    assert (GOOD + len(BAD_VALUES)) / 32 <= batches <= GOOD + len(BAD_VALUES)
    closed = {
        dict(k)["reason"]: v for k, v in series(samples, "pipeline_batches_closed_total").items()
    }
    assert set(closed) <= {"records", "tokens", "age", "caught_up", "shutdown"}, closed
    assert sum(closed.values()) == batches  # every batch handed off was committed


def check_histograms(samples: Samples) -> None:
    batches = value(samples, "pipeline_batches_total") or 0
    records = value(samples, "pipeline_batch_records_count")
    assert records is not None and records >= batches
    assert value(samples, "pipeline_batch_records_sum") == GOOD + len(BAD_VALUES)
    for name in ("pipeline_batch_tokens", "pipeline_embed_seconds"):
        count = value(samples, f"{name}_count")
        assert count is not None and 1 <= count <= batches, name
        assert (value(samples, f"{name}_sum") or 0) > 0, name
    # Every real token is counted once: at least one (plus [CLS], [SEP]) per record.
    assert (value(samples, "pipeline_batch_tokens_sum") or 0) >= 3 * GOOD
    assert value(samples, "pipeline_write_seconds_count") == batches
    assert (value(samples, "pipeline_commit_seconds_count") or 0) >= 1
    for name in ("pipeline_embed_seconds", "pipeline_write_seconds", "pipeline_commit_seconds"):
        total = value(samples, f"{name}_count")
        assert value(samples, f"{name}_bucket", le="+Inf") == total, name


def check_gauges(samples: Samples, topic: str) -> None:
    efficiency = value(samples, "pipeline_padding_efficiency")
    assert efficiency is not None and 0 < efficiency <= 1
    in_flight = value(samples, "pipeline_batches_in_flight")
    assert in_flight is not None and 0 <= in_flight <= MAX_IN_FLIGHT
    paused = value(samples, "pipeline_paused_partitions")
    assert paused is not None and 0 <= paused <= PARTITIONS
    lag = series(samples, "pipeline_partition_lag")
    assert sorted(lag) == [
        (("partition", str(p)), ("tier", "nearline"), ("topic", topic)) for p in range(PARTITIONS)
    ]
    assert all(v == 0 for v in lag.values()), lag  # everything was consumed and committed
