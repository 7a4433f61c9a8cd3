"""The records a seed publishes: good ones of every codec, bad ones that must reach
the dead-letter topic, and the Java producer's (codecs, transactions, aborts)."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chaos.broker import Broker
from chaos.common import CODECS, FOREIGN_PRODUCER, MAX_TEXT_BYTES, HarnessError

_WORDS_TEXT = (
    "river stone quiet harbour lantern copper orchard signal winter meadow engine "
    "letter violet thunder garden market silver compass shadow window ladder bridge "
    "story kettle forest island pocket mirror candle valley whisper anchor rhythm"
)
WORDS = _WORDS_TEXT.split()


def good_value(rng: random.Random, ident: str, long_texts: bool = False) -> bytes:
    count = rng.randint(200, 400) if long_texts else rng.randint(3, 40)
    words = " ".join(rng.choice(WORDS) for _ in range(count))
    value: dict[str, Any] = {"id": ident, "text": f"{words.capitalize()}. ({ident})"}
    if rng.random() < 0.3:
        value["lang"] = rng.choice(["en", "fr", "de"])
    return json.dumps(value).encode()


BadMaker = Callable[[random.Random, str], tuple[bytes | None, bytes | None]]

BAD_MAKERS: dict[str, BadMaker] = {
    "invalid-json": lambda rng, i: (None, b'{"id": "' + i.encode() + b'", "text": '),
    "empty-text": lambda rng, i: (None, json.dumps({"id": i, "text": ""}).encode()),
    "blank-text": lambda rng, i: (None, json.dumps({"id": i, "text": " \n\t "}).encode()),
    "missing-text": lambda rng, i: (None, json.dumps({"id": i, "body": "no text"}).encode()),
    "text-not-string": lambda rng, i: (None, json.dumps({"id": i, "text": 42}).encode()),
    "not-an-object": lambda rng, i: (None, json.dumps(["text", i]).encode()),
    "invalid-utf8": lambda rng, i: (None, b'{"text": "\xff\xfe ' + i.encode() + b'"}'),
    "tombstone": lambda rng, i: (f"tomb-{i}".encode(), None),
    "oversize": lambda rng, i: (None, json.dumps({"id": i, "text": "x" * 100_000}).encode()),
}


def bad_item(rng: random.Random, ident: str) -> tuple[bytes | None, bytes | None]:
    kinds = [k for k in BAD_MAKERS if k != "oversize" or rng.random() < 0.1]
    return BAD_MAKERS[rng.choice(kinds)](rng, ident)


def is_bad(value: bytes | None) -> bool:
    """The contract's definition of a bad record, written independently of the worker."""
    if value is None:
        return True
    try:
        obj = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return True
    if not isinstance(obj, dict):
        return True
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        return True
    return len(text.encode("utf-8")) > MAX_TEXT_BYTES


def value_text(value: bytes | None) -> str | None:
    if is_bad(value):
        return None
    assert value is not None
    return json.loads(value.decode("utf-8"))["text"]


class Ids:
    """Unique record ids for one seed, shared by every publishing thread."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            return f"py-{self._seed}-{next(self._counter)}"


@dataclass
class Published:
    """What the harness published (the check reads the topic itself; this is for the report)."""

    python: int = 0
    python_bad: int = 0
    java: int = 0
    java_committed_ids: set[str] = field(default_factory=set)
    java_aborted_ids: set[str] = field(default_factory=set)
    codecs: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def make_items(
    rng: random.Random, ids: Ids, count: int, bad_ratio: float, long_texts: bool = False
) -> list[tuple[bytes | None, bytes | None, bool]]:
    items = []
    for _ in range(count):
        ident = ids.next()
        if rng.random() < bad_ratio:
            key, value = bad_item(rng, ident)
            items.append((key, value, True))
        else:
            key = ident.encode() if rng.random() < 0.5 else None
            items.append((key, good_value(rng, ident, long_texts), False))
    return items


@dataclass(frozen=True)
class Target:
    """Where a seed publishes, and what its texts look like."""

    bootstrap: str
    topic: str
    partitions: int
    long_texts: bool = False
    bad_ratio: float = 0.03  # the share of bad records (plans.Plan.bad_ratio)


def publish_python(
    target: Target,
    rng: random.Random,
    ids: Ids,
    count: int,
    published: Published,
) -> str:
    """Publishes `count` records with kafka-python and one random codec; returns the codec."""
    from kafka import KafkaProducer

    codec = rng.choice(CODECS)
    items = make_items(rng, ids, count, target.bad_ratio, target.long_texts)
    spread = rng.choice(["round-robin", "random", "one"])
    partitions, topic = target.partitions, target.topic
    producer = KafkaProducer(
        bootstrap_servers=target.bootstrap,
        acks="all",
        compression_type=None if codec == "none" else codec,
        linger_ms=rng.choice([0, 5, 50]),
        batch_size=rng.choice([16_384, 262_144]),
        retries=20,
        request_timeout_ms=20_000,
        delivery_timeout_ms=120_000,
        max_block_ms=60_000,
    )
    try:
        first = rng.randrange(partitions)
        for n, (key, value, _) in enumerate(items):
            part = {"round-robin": (first + n) % partitions, "one": first}.get(
                spread, rng.randrange(partitions)
            )
            producer.send(topic, key=key, value=value, partition=part)
        producer.flush(120)
    finally:
        producer.close(timeout=10)
    with published.lock:
        published.python += len(items)
        published.python_bad += sum(1 for *_, bad in items if bad)
        published.codecs[codec] += len(items)
    return codec


class JavaIds:
    """Disjoint --start-id ranges for successive Java producer runs."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def take(self, count: int) -> int:
        with self._lock:
            start, self._next = self._next, self._next + count
            return start


def publish_java(
    broker: Broker,
    topic: str,
    partitions: int,
    rng: random.Random,
    java_ids: JavaIds,
    published: Published,
) -> dict[str, Any] | None:
    """One run of the official Java producer; None when the helper is absent."""
    if not FOREIGN_PRODUCER.exists():
        return None
    count = rng.randint(60, 300)
    codec = rng.choice(CODECS)
    transactions = rng.choice(["none", "commit", "abort-alternate", "abort-alternate"])
    args = [
        "java",
        "-cp",
        broker.classpath(),
        str(FOREIGN_PRODUCER),
        "--bootstrap",
        broker.bootstrap,
        "--topic",
        topic,
        "--count",
        str(count),
        "--compression",
        codec,
        "--transactions",
        transactions,
        "--per-transaction",
        str(rng.randint(3, 40)),
        "--partitions",
        str(partitions),
        "--start-id",
        str(java_ids.take(count)),
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        raise HarnessError(f"ForeignProducer exited {done.returncode}: {done.stderr[-2000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    with published.lock:
        published.java += int(summary["sent"])
        published.java_committed_ids |= set(summary["committed_ids"])
        published.java_aborted_ids |= set(summary["aborted_ids"])
        published.codecs[f"java-{codec}"] += int(summary["sent"])
    return {
        "count": count,
        "compression": codec,
        "transactions": transactions,
        "aborted": len(summary["aborted_ids"]),
    }
