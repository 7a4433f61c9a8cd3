"""The records a seed publishes: good ones of every codec, bad ones that must reach
the dead-letter topic, and the Java producer's (codecs, transactions, aborts).

In upsert mode (`--write-mode upsert`) the good records are versions of documents
from a bounded pool of ids (`Documents`): new documents, updates (some twice or
more), tombstones of documents published before (deletions, not bad records) and
documents published again after their deletion (re-adds). Each is keyed by its
document id (the Kafka key is the id's bytes) and sent to the partition that key
hashes to, so one document stays in one partition. Bad records stay, with the ones
only upsert mode has: no usable document key, a key that is not UTF-8 or too long.
The Java producer's records (unique ids `java-<n>`, Kafka keys `k-<n>`, partition
n mod P) are documents published once each: inserts.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import threading
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chaos.broker import Broker
from chaos.common import CODECS, FOREIGN_PRODUCER, MAX_TEXT_BYTES, HarnessError
from chaos.long_texts import LongTexts

_WORDS_TEXT = (
    "river stone quiet harbour lantern copper orchard signal winter meadow engine "
    "letter violet thunder garden market silver compass shadow window ladder bridge "
    "story kettle forest island pocket mirror candle valley whisper anchor rhythm"
)
WORDS = _WORDS_TEXT.split()


def good_value(
    rng: random.Random,
    ident: str,
    long_texts: bool = False,
    version: int | None = None,
    with_id: bool = True,
    corpus: LongTexts | None = None,
) -> bytes:
    """A good record; `version`: upsert mode's version of document `ident` (in its text,
    so that every version's text differs); `with_id=False`: no id field (upsert mode
    then names the document by the Kafka key); `corpus` (chunk mode): some records
    long (chunked into many), medium or Chinese, the rest as without it."""
    tag = ident if version is None else f"{ident} v{version}"
    drawn = corpus.text(rng, tag) if corpus is not None else None
    if drawn is not None:
        text = drawn.text
    else:
        count = rng.randint(200, 400) if long_texts else rng.randint(3, 40)
        words = " ".join(rng.choice(WORDS) for _ in range(count))
        text = f"{words.capitalize()}. ({tag})"
    value: dict[str, Any] = {"id": ident, "text": text}
    if not with_id:
        del value["id"]
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


# -- upsert mode ----------------------------------------------------------------------------

MAX_KEY_BYTES = 1024  # the worker's default bound of a document key (--max-key-bytes)
GOOD, DELETE, BAD = "good", "delete", "bad"


def _utf8(key: bytes | None) -> str | None:
    if key is None:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return None


def upsert_verdict(key: bytes | None, value: bytes | None) -> tuple[str, str | None]:
    """Upsert mode's contract (`--document-key id`), written independently of the worker:
    (GOOD, document) for a version of a document, (DELETE, document) for a tombstone
    that deletes one, (BAD, None) for a dead letter. The document is the value's `id`
    (a JSON non-string as JSON text), else the Kafka key as UTF-8; a tombstone's is its
    Kafka key. None, empty, not UTF-8 or over MAX_KEY_BYTES: a bad record."""
    if value is None:
        kind, document = DELETE, _utf8(key)
    else:
        if is_bad(value):
            return BAD, None
        ident = json.loads(value.decode("utf-8")).get("id")
        if ident is not None and not isinstance(ident, str):
            ident = json.dumps(ident)
        kind, document = GOOD, ident if ident is not None else _utf8(key)
    if not document or len(document.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return BAD, None
    return kind, document


def _text(i: str) -> str:
    return f"Lantern by the river ({i})"


# Records upsert mode alone sends to the dead letters: no usable document key. (A
# tombstone without any key is one too, but kafka-python refuses to send one.)
UPSERT_BAD_MAKERS: dict[str, BadMaker] = {
    "tombstone-empty-key": lambda rng, i: (b"", None),
    "tombstone-key-not-utf8": lambda rng, i: (b"\xff\xfe" + i.encode(), None),
    "no-id-no-key": lambda rng, i: (None, json.dumps({"text": _text(i)}).encode()),
    "no-id-key-not-utf8": lambda rng, i: (
        b"\xff" + i.encode(),
        json.dumps({"text": _text(i)}).encode(),
    ),
    "empty-id": lambda rng, i: (i.encode(), json.dumps({"id": "", "text": _text(i)}).encode()),
    "id-too-long": lambda rng, i: (
        None,
        json.dumps({"id": i + "x" * MAX_KEY_BYTES, "text": _text(i)}).encode(),
    ),
    "kafka-key-too-long": lambda rng, i: (
        (i + "y" * MAX_KEY_BYTES).encode(),
        json.dumps({"text": _text(i)}).encode(),
    ),
}


class Documents:
    """Upsert-mode traffic of one seed, shared by every publishing thread: a bounded pool
    of document ids, each id's versions, and which ids the harness has deleted (for
    tombstones of published documents and for re-adds). The check reads the topic
    itself; what is counted here is for the report."""

    def __init__(self, seed: int, pool_size: int) -> None:
        self.pool = [f"doc-{seed}-{n}" for n in range(pool_size)]
        self._used = 0  # pool[:_used] have been published
        self._versions: Counter[str] = Counter()
        self._live: list[str] = []  # published, not deleted since (in the harness's order)
        self._deleted: list[str] = []
        self.counts: Counter[str] = Counter()  # inserts, updates, deletions, re-adds
        self._lock = threading.Lock()

    def version(self, rng: random.Random) -> tuple[str, int]:
        """The document the next good record is a version of, and its version number."""
        with self._lock:
            exhausted = self._used == len(self.pool)
            readd = 0.4 * len(self._deleted) / max(self._used, 1)  # about a fifth stay deleted
            if self._deleted and (rng.random() < readd or (not self._live and exhausted)):
                ident = self._deleted.pop(rng.randrange(len(self._deleted)))
                self._live.append(ident)
                self.counts["re-adds"] += 1
            elif not exhausted and (not self._live or rng.random() < 0.3):
                ident = self.pool[self._used]
                self._used += 1
                self._live.append(ident)
                self.counts["inserts"] += 1
            else:
                ident = self._live[rng.randrange(len(self._live))]
                self.counts["updates"] += 1
            self._versions[ident] += 1
            return ident, self._versions[ident]

    def deletion(self, rng: random.Random) -> str | None:
        """A published document to delete (None: none is live)."""
        with self._lock:
            if not self._live:
                return None
            ident = self._live.pop(rng.randrange(len(self._live)))
            self._deleted.append(ident)
            self.counts["deletions"] += 1
            return ident

    def any_published(self, rng: random.Random) -> str | None:
        with self._lock:
            return self.pool[rng.randrange(self._used)] if self._used else None


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
    rng: random.Random,
    ids: Ids,
    count: int,
    bad_ratio: float,
    long_texts: bool = False,
    corpus: LongTexts | None = None,
) -> list[tuple[bytes | None, bytes | None, bool]]:
    items = []
    for _ in range(count):
        ident = ids.next()
        if rng.random() < bad_ratio:
            key, value = bad_item(rng, ident)
            items.append((key, value, True))
        else:
            key = ident.encode() if rng.random() < 0.5 else None
            items.append((key, good_value(rng, ident, long_texts, corpus=corpus), False))
    return items


def make_upsert_items(
    rng: random.Random,
    docs: Documents,
    ids: Ids,
    count: int,
    bad_ratio: float,
    long_texts: bool = False,
    corpus: LongTexts | None = None,
) -> list[tuple[bytes | None, bytes | None, bool]]:
    """Upsert-mode records: versions of pooled documents keyed by their ids, tombstones
    of published documents (about one in fifteen), re-adds, and bad records (generic
    ones keyed by a published document's id, and upsert mode's own)."""
    items: list[tuple[bytes | None, bytes | None, bool]] = []
    for _ in range(count):
        draw = rng.random()
        if draw < bad_ratio:
            ident = ids.next()
            if rng.random() < 0.4:
                key, value = UPSERT_BAD_MAKERS[rng.choice(list(UPSERT_BAD_MAKERS))](rng, ident)
                items.append((key, value, True))
                continue
            kinds = [k for k in BAD_MAKERS if k != "tombstone"]
            _, value = BAD_MAKERS[rng.choice(kinds)](rng, ident)
            document = docs.any_published(rng)  # a bad version of a document changes nothing
            items.append((document.encode() if document else None, value, True))
            continue
        deleted = docs.deletion(rng) if draw < bad_ratio + 0.065 else None
        if deleted is not None:
            items.append((deleted.encode(), None, False))
            continue
        document, version = docs.version(rng)
        with_id = rng.random() >= 0.15
        value = good_value(rng, document, long_texts, version, with_id, corpus)
        items.append((document.encode(), value, False))
    return items


def key_partition(key: bytes, partitions: int) -> int:
    """The partition of a keyed record in upsert mode: one document, one partition."""
    return zlib.crc32(key) % partitions


@dataclass(frozen=True)
class Target:
    """Where a seed publishes, and what its texts look like."""

    bootstrap: str
    topic: str
    partitions: int
    long_texts: bool = False
    bad_ratio: float = 0.03  # the share of bad records (plans.Plan.bad_ratio)
    corpus: LongTexts | None = None  # chunk mode's long, medium and Chinese texts


def publish_python(
    target: Target,
    rng: random.Random,
    ids: Ids,
    count: int,
    published: Published,
    docs: Documents | None = None,
) -> str:
    """Publishes `count` records with kafka-python and one random codec; returns the codec.
    With `docs` (upsert mode), versions of documents, each to its key's partition."""
    from kafka import KafkaProducer

    codec = rng.choice(CODECS)
    if docs is None:
        items = make_items(rng, ids, count, target.bad_ratio, target.long_texts, target.corpus)
    else:
        items = make_upsert_items(
            rng, docs, ids, count, target.bad_ratio, target.long_texts, target.corpus
        )
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
            if docs is not None and key:  # a document's records: its key's partition
                part = key_partition(key, partitions)
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
