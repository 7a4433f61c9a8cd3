"""Input from any producer (CONTRACT.md; issue 9, items 4 and 5): records from the official
Java client with each compression codec and with transactions, and from kafka-python's own
producer with each codec, are embedded exactly once by the real worker (`pipeline run
--until-end`); aborted transactions never reach the outputs.

The checks are independent of the worker: a read_committed kafka-python consumer lists the
real records of each topic (offsets, ids, texts), and the producer's own report says which ids
were committed and which aborted. Where the broker's log files are on this machine (the
scripts/dev-kafka.sh broker), the stored batches are checked too, so that a test really fed
the worker the codec and the transaction markers it names.

The worker loads the real model at every run, so each group of cases (Java codecs, Java
transactions, kafka-python codecs) is one worker run over one topic per case (a module-scoped
fixture), and the parametrized tests check their own topic of that run."""

from __future__ import annotations

import subprocess
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.foreign import (
    CODEC_IDS,
    CODECS,
    Offset,
    Record,
    committed_records,
    java_produce,
    output_records,
    python_produce,
    stored_batches,
)
from tests.helpers import run_until_end, topic_factory

pytestmark = pytest.mark.integration

WORKER_FLAGS = ("--batch-size", "64")
WORKER_TIMEOUT_S = 240
# (codec, partitions) of the Java codec cases; 120 records each.
JAVA_CODECS = [("gzip", 2), ("snappy", 3), ("lz4", 3), ("zstd", 2)]
JAVA_RECORDS = 120
# (codec, transactions, records) of the Java transactional cases, transactions of 10 records.
JAVA_TRANSACTIONS = [("none", "abort-alternate", 300), ("lz4", "commit", 100)]
PER_TRANSACTION = 10
PYTHON_RECORDS = 40


@dataclass(frozen=True)
class Case:
    topic: str
    codec: str
    transactional: bool
    report: dict[str, Any]  # the producer's: sent, committed_ids, aborted_ids


@dataclass(frozen=True)
class Run:
    """One `pipeline run --until-end` over the topics of its cases."""

    cases: dict[str, Case]
    output: Path
    error: str | None  # None when the worker exited 0


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def module_topic(broker: str) -> Iterator[Callable[..., str]]:
    """Fresh topics for the module, deleted at its end."""
    with topic_factory(broker) as create:
        yield create


def run_cases(broker: str, cases: dict[str, Case], output: Path) -> Run:
    topics = [case.topic for case in cases.values()]
    return Run(cases, output, run_worker(broker, topics, f"g-{uuid.uuid4().hex[:10]}", output))


@pytest.fixture(scope="module")
def java_codecs(
    broker: str, module_topic: Callable[[int, str], str], tmp_path_factory: pytest.TempPathFactory
) -> Run:
    cases: dict[str, Case] = {}
    for codec, partitions in JAVA_CODECS:
        topic = module_topic(partitions, f"java-{codec}")
        report = java_produce(broker, topic, JAVA_RECORDS, compression=codec)
        cases[codec] = Case(topic, codec, False, report)
    return run_cases(broker, cases, tmp_path_factory.mktemp("java-codecs") / "out")


@pytest.fixture(scope="module")
def java_transactions(
    broker: str, module_topic: Callable[[int, str], str], tmp_path_factory: pytest.TempPathFactory
) -> Run:
    cases: dict[str, Case] = {}
    for codec, transactions, count in JAVA_TRANSACTIONS:
        topic = module_topic(3, f"java-txn-{codec}")
        report = java_produce(
            broker,
            topic,
            count,
            compression=codec,
            transactions=transactions,
            per_transaction=PER_TRANSACTION,
        )
        cases[f"{transactions}-{codec}"] = Case(topic, codec, True, report)
    return run_cases(broker, cases, tmp_path_factory.mktemp("java-transactions") / "out")


@pytest.fixture(scope="module")
def python_codecs(
    broker: str, module_topic: Callable[[int, str], str], tmp_path_factory: pytest.TempPathFactory
) -> Run:
    cases: dict[str, Case] = {}
    for codec in CODECS:
        topic = module_topic(2, f"py-{codec}")
        ids = python_produce(broker, topic, PYTHON_RECORDS, codec, 2)
        report = {"sent": len(ids), "committed_ids": ids, "aborted_ids": []}
        cases[codec] = Case(topic, codec, False, report)
    return run_cases(broker, cases, tmp_path_factory.mktemp("python-codecs") / "out")


# ------------------------------------------------------------------ checks


def run_worker(broker: str, topics: list[str], group: str, output: Path) -> str | None:
    """Runs `pipeline run --until-end` over the topics; None when it exited 0, else why not."""
    try:
        done = run_until_end(broker, topics, group, output, *WORKER_FLAGS, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return f"--until-end did not finish within {WORKER_TIMEOUT_S}s:\n{tail(e.stderr)}"
    if done.returncode != 0:
        return f"the worker exited {done.returncode}:\n{tail(done.stderr)}"
    return None


def tail(text: str | bytes | None, lines: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def assert_exactly_once(broker: str, run: Run, name: str) -> None:
    """The worker exited 0, and every record a read_committed reader sees in the case's topic
    is in exactly one Parquet row with its id and text; no other row of the topic exists; those
    records are the ids the producer committed; no aborted id is a row."""
    case = run.cases[name]
    rows = [(offset, rec) for offset, rec in output_records(run.output) if offset[0] == case.topic]
    aborted = sorted(set(case.report["aborted_ids"]) & {record.id for _, record in rows})
    failures = [run.error] if run.error else []
    if aborted:
        failures.append(f"{len(aborted)} aborted records embedded, e.g. {aborted[:5]}")
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    assert_rows_are_records(broker, case.topic, rows, case.report["committed_ids"])


def assert_rows_are_records(
    broker: str, topic: str, rows: list[tuple[Offset, Any]], committed_ids: list[str]
) -> None:
    real = committed_records(broker, topic)
    assert sorted(r.id or "" for r in real.values()) == sorted(committed_ids), (
        "the topic does not hold what the producer committed"
    )
    counts = Counter(offset for offset, _ in rows)
    problems = {
        "missing": sorted(set(real) - set(counts)),
        "doubled": sorted(o for o, n in counts.items() if n > 1),
        "not a committed record": sorted(set(counts) - set(real)),
    }
    assert not any(problems.values()), describe(problems, len(real), len(rows))
    wrong = [(offset, record, real[offset]) for offset, record in rows if record != real[offset]]
    assert not wrong, f"{len(wrong)} rows differ from their records, e.g. {wrong[:3]}"


def describe(problems: dict[str, list[Offset]], records: int, rows: int) -> str:
    parts = [f"{len(v)} {k} (e.g. {v[:5]})" for k, v in problems.items() if v]
    return f"{records} committed records, {rows} rows: " + "; ".join(parts)


def assert_stored(case: Case, *, strict_codec: bool = True) -> None:
    """The broker holds every record sent in batches of the case's codec (transactional or
    not) and, for transactions, markers. Skipped where the broker's files are not local."""
    batches = stored_batches(case.topic)
    if batches is None:
        return
    data = [b for b in batches if not b.control]
    assert sum(b.records for b in data) == case.report["sent"], "the log lacks records sent"
    codecs = Counter(b.codec for b in data)
    if strict_codec:
        assert set(codecs) == {CODEC_IDS[case.codec]}, f"batch codecs {codecs}, not {case.codec}"
    else:  # kafka-python keeps a batch uncompressed when compression does not pay
        assert codecs[CODEC_IDS[case.codec]] >= len(data) / 2, f"batch codecs {codecs}"
    assert all(b.transactional == case.transactional for b in data)
    assert any(b.control for b in batches) == case.transactional, "transaction markers"


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("codec", [codec for codec, _ in JAVA_CODECS])
def test_java_producer_codec(codec: str, broker: str, java_codecs: Run) -> None:
    assert_stored(java_codecs.cases[codec])
    assert_exactly_once(broker, java_codecs, codec)


@pytest.mark.parametrize(
    "case", [f"{transactions}-{codec}" for codec, transactions, _ in JAVA_TRANSACTIONS]
)
def test_java_transactional_producer(case: str, broker: str, java_transactions: Run) -> None:
    report = java_transactions.cases[case].report
    if case.startswith("abort-alternate"):
        assert len(report["aborted_ids"]) == report["sent"] // 2
    assert_stored(java_transactions.cases[case])
    assert_exactly_once(broker, java_transactions, case)


@pytest.mark.parametrize("codec", CODECS)
def test_kafka_python_producer_codec(codec: str, broker: str, python_codecs: Run) -> None:
    assert_stored(python_codecs.cases[codec], strict_codec=False)
    assert_exactly_once(broker, python_codecs, codec)


def test_rows_check_can_fail(broker: str, make_topic) -> None:
    """The check above fails on missing, doubled and altered rows."""
    topic = make_topic(1, prefix="py-none")
    ids = python_produce(broker, topic, 3, "none", 1)
    real = sorted(committed_records(broker, topic).items())
    with pytest.raises(AssertionError, match="3 missing"):
        assert_rows_are_records(broker, topic, [], ids)
    with pytest.raises(AssertionError, match="1 doubled"):
        assert_rows_are_records(broker, topic, [*real, real[0]], ids)
    altered = [(offset, Record(record.id, record.text + "!")) for offset, record in real]
    with pytest.raises(AssertionError, match="3 rows differ"):
        assert_rows_are_records(broker, topic, altered, ids)
    with pytest.raises(AssertionError, match="what the producer committed"):
        assert_rows_are_records(broker, topic, real, [*ids, "py-aborted"])
