"""The one Kafka layer outside the hot path: clients, topics, offsets, groups.

The CLI, the worker and `pipeline status` all talk to the cluster through this
module, under one policy:

- every call is bounded by a deadline;
- retriable errors (the coordinator loading or moving, a leader change, a
  broker restarting, a request timing out) are retried with exponential
  backoff until the deadline;
- past it, or on an error that no retry mends, one `PipelineError` with one
  actionable line: `BrokerUnavailable` when the cluster did not answer,
  `TopicMissing` for a topic that does not exist, a wrong credential or
  certificate as its own error (`AccessDenied`, `SecureConnectionFailed`,
  `SetupError`: pipeline.kafka.failures, caught before the first client starts by
  pipeline.kafka.access), `PipelineError` otherwise.

A freshly formatted broker has no `__consumer_offsets` topic yet: the first
group operation sees CoordinatorNotAvailable for a few seconds, which is just
one more retriable error here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import kafka.errors as kerrors
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from pipeline.core.config import KafkaSettings
from pipeline.core.errors import BrokerUnavailable, PipelineError, TopicMissing
from pipeline.kafka import access, failures, internals
from pipeline.kafka.failures import unreachable  # the line every command says it with

log = logging.getLogger(__name__)
T = TypeVar("T")

BOOTSTRAP_TIMEOUT_MS = 10_000
# How long a cluster call keeps retrying retriable errors before giving up:
# long enough for a broker restart or a coordinator election, short enough
# that a command run by hand does not seem to hang.
DEFAULT_DEADLINE_S = 60.0
_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 2.0


# --------------------------------------------------------------------------- the policy


def is_retriable(exc: BaseException) -> bool:
    return isinstance(exc, kerrors.KafkaError) and bool(exc.retriable)


def retrying(
    call: Callable[[], T],
    what: str,
    kafka: KafkaSettings,
    deadline_s: float = DEFAULT_DEADLINE_S,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Runs `call`, retrying retriable Kafka errors with backoff for up to `deadline_s`.

    `what` names the operation in the error a user sees ("reading committed
    offsets of group g"). Non-retriable Kafka errors, and a TLS failure kafka-python
    words as a retriable connection error, become their typed error at once
    (failures.from_kafka); retriable ones past the deadline become BrokerUnavailable.
    """
    deadline = time.monotonic() + deadline_s
    backoff = _BACKOFF_FIRST_S
    while True:
        try:
            return call()
        except kerrors.KafkaError as exc:
            if not is_retriable(exc) or failures.security_failure(exc, kafka) is not None:
                raise failures.from_kafka(exc, kafka, what) from exc
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrokerUnavailable(
                    f"{what}: the cluster at {kafka.bootstrap_servers} did not answer within "
                    f"{deadline_s:.0f}s ({exc}); check that the brokers are up and reachable"
                ) from exc
            log.debug("%s: %s; retrying in %.1fs", what, exc, backoff)
            sleep(min(backoff, left))
            backoff = min(backoff * 2, _BACKOFF_MAX_S)


# --------------------------------------------------------------------------- clients


def client_kwargs(kafka: KafkaSettings, request_timeout_ms: int | None = None) -> dict[str, Any]:
    """What every client of the pipeline is built with: the connection settings, the
    TLS files loaded here (access.connection_configs), bounded bootstrap."""
    kwargs = access.connection_configs(kafka)
    kwargs["bootstrap_timeout_ms"] = BOOTSTRAP_TIMEOUT_MS
    if request_timeout_ms is not None:
        kwargs["request_timeout_ms"] = min(kafka.request_timeout_ms, request_timeout_ms)
    return kwargs


def build_client(make: Callable[..., T], kafka: KafkaSettings, **configs: Any) -> T:
    """Builds a kafka-python client (`make`: KafkaConsumer, KafkaProducer, ...).

    A wrong credential or certificate is its typed error at once (access.check, the
    first client of a configuration); no broker answering is BrokerUnavailable once
    the client's bootstrap gave up. The network thread of a client that failed to
    start is stopped, so that retries (and `status --watch` against a broker that is
    down) do not leak threads.
    """
    access.check(kafka, int(configs.get("bootstrap_timeout_ms", BOOTSTRAP_TIMEOUT_MS)))
    clients = internals.NetClients()
    try:
        return make(**configs, kafka_client=clients)
    except BaseException as exc:
        clients.stop()
        if isinstance(exc, kerrors.KafkaError):
            raise failures.security_failure(exc, kafka) or unreachable(kafka, exc) from exc
        raise


@contextmanager
def admin_client(
    kafka: KafkaSettings, request_timeout_ms: int | None = None
) -> Iterator[KafkaAdminClient]:
    admin = build_client(KafkaAdminClient, kafka, **client_kwargs(kafka, request_timeout_ms))
    try:
        yield admin
    finally:
        admin.close()


@contextmanager
def offsets_consumer(
    kafka: KafkaSettings, request_timeout_ms: int | None = None, **configs: Any
) -> Iterator[KafkaConsumer]:
    """A consumer outside any group, reading committed data only (for offsets and probes)."""
    settings = dict(
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",
        **client_kwargs(kafka, request_timeout_ms),
    )
    settings.update(configs)
    consumer = build_client(KafkaConsumer, kafka, **settings)
    try:
        yield consumer
    finally:
        consumer.close(autocommit=False, timeout_ms=2_000)


# --------------------------------------------------------------------------- topics


def describe_partitions(
    admin: KafkaAdminClient,
    kafka: KafkaSettings,
    topics: Sequence[str],
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> dict[str, list[int] | None]:
    """Partition numbers per topic; None for a topic that does not exist."""
    described = retrying(
        lambda: admin.describe_topics(list(topics)),
        f"describing topic(s) {', '.join(topics)}",
        kafka,
        deadline_s,
    )
    found: dict[str, list[int] | None] = dict.fromkeys(topics)
    for topic in described:
        if topic.get("error_code", 0) == 0 and topic["name"] in found and topic.get("partitions"):
            found[topic["name"]] = sorted(p["partition_index"] for p in topic["partitions"])
    return found


def partitions_of(
    admin: KafkaAdminClient, kafka: KafkaSettings, topics: Sequence[str]
) -> list[TopicPartition]:
    """All partitions of the topics; TopicMissing names those that do not exist."""
    found = describe_partitions(admin, kafka, topics)
    missing = sorted(t for t, parts in found.items() if parts is None)
    if missing:
        raise TopicMissing(
            f"topic(s) {', '.join(missing)} do not exist; create them with: "
            f"pipeline topics create TOPIC --partitions N"
        )
    return sorted(TopicPartition(t, p) for t, parts in found.items() for p in parts or [])


def create_topic(
    admin: KafkaAdminClient,
    kafka: KafkaSettings,
    topic: str,
    partitions: int,
    replication: int = 1,
) -> bool:
    """Creates a topic; False if it already existed with that many partitions."""

    def create() -> bool:
        try:
            admin.create_topics(
                {topic: {"num_partitions": partitions, "replication_factor": replication}},
                timeout_ms=30_000,
                wait_for_metadata=True,
            )
            return True
        except kerrors.TopicAlreadyExistsError:
            return False

    created = retrying(create, f"creating topic {topic}", kafka)
    if not created:
        existing = len(partitions_of(admin, kafka, [topic]))
        if existing != partitions:
            raise PipelineError(
                f"topic {topic} already exists with {existing} partitions, not {partitions}"
            )
    return created


def ensure_topic(
    admin: KafkaAdminClient, kafka: KafkaSettings, topic: str, partitions: int = 1
) -> None:
    """Creates the topic when it is missing (used for the dead-letter topic)."""
    if describe_partitions(admin, kafka, [topic])[topic] is None:
        try:
            created = create_topic(admin, kafka, topic, partitions)
        except PipelineError:
            # Several workers starting together race to create it; one wins.
            if describe_partitions(admin, kafka, [topic])[topic] is None:
                raise
            return
        if created:
            log.info("created topic %s (%d partition(s))", topic, partitions)


# --------------------------------------------------------------------------- offsets


def group_offsets(
    admin: KafkaAdminClient,
    kafka: KafkaSettings,
    group: str,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> dict[TopicPartition, int]:
    """Committed offsets of a group (partitions without a commit are absent)."""
    return {tp: meta.offset for tp, meta in group_commits(admin, kafka, group, deadline_s).items()}


def group_commits(
    admin: KafkaAdminClient,
    kafka: KafkaSettings,
    group: str,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> dict[TopicPartition, Any]:
    """Committed offsets of a group with their metadata (OffsetAndMetadata), the same
    partitions as `group_offsets`."""
    result: dict[str, dict[TopicPartition, Any]] = retrying(
        lambda: admin.list_group_offsets({group: None}),
        f"reading committed offsets of group {group}",
        kafka,
        deadline_s,
    )
    return {
        tp: meta
        for tp, meta in result.get(group, {}).items()
        if meta.offset is not None and meta.offset >= 0
    }


def end_offsets(
    consumer: KafkaConsumer,
    kafka: KafkaSettings,
    partitions: Sequence[TopicPartition],
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> dict[TopicPartition, int]:
    """End offsets; with a read_committed consumer, the last stable offsets."""
    return _list_offsets(consumer.end_offsets, "end", kafka, partitions, deadline_s)


def beginning_offsets(
    consumer: KafkaConsumer,
    kafka: KafkaSettings,
    partitions: Sequence[TopicPartition],
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> dict[TopicPartition, int]:
    """First offsets still retained."""
    return _list_offsets(consumer.beginning_offsets, "beginning", kafka, partitions, deadline_s)


def offsets_for_times(
    consumer: KafkaConsumer,
    kafka: KafkaSettings,
    timestamps: Mapping[TopicPartition, int],
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> dict[TopicPartition, int | None]:
    """First offset whose record timestamp is at or after each time (ms); None past the last."""
    if not timestamps:
        return {}
    found = retrying(
        # A fresh dict on each try: kafka-python rewrites the one it is given.
        lambda: consumer.offsets_for_times(dict(timestamps), timeout_ms=10_000),
        "looking up offsets by time",
        kafka,
        deadline_s,
    )
    return {tp: None if hit is None else hit.offset for tp, hit in found.items()}


def _list_offsets(
    lookup: Callable[..., dict[TopicPartition, int]],
    which: str,
    kafka: KafkaSettings,
    partitions: Sequence[TopicPartition],
    deadline_s: float,
) -> dict[TopicPartition, int]:
    if not partitions:
        return {}
    return retrying(
        lambda: dict(lookup(list(partitions), timeout_ms=10_000)),
        f"reading {which} offsets",
        kafka,
        deadline_s,
    )


# --------------------------------------------------------------------------- groups

# States in which a classic group has nobody to take its commits from: only then
# may an outsider move its offsets (kafka-consumer-groups.sh --reset-offsets agrees).
INACTIVE_GROUP_STATES = frozenset({"Empty", "Dead"})


@dataclass(frozen=True)
class GroupMember:
    client_id: str
    host: str
    member_id: str = ""
    # (topic, partition) pairs; empty for a protocol other than the consumer's.
    assignments: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class GroupInfo:
    """A group's state and live members; a group that does not exist is Dead."""

    state: str
    members: tuple[GroupMember, ...]

    @property
    def active(self) -> bool:
        return bool(self.members) or self.state not in INACTIVE_GROUP_STATES


def describe_group(
    admin: KafkaAdminClient,
    kafka: KafkaSettings,
    group: str,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> GroupInfo:
    """The group's state, members and their assignments, retrying a coordinator that
    is loading or moving (`offsets reset` and `pipeline status` both ask)."""

    def describe() -> GroupInfo:
        info = admin.describe_groups([group]).get(group, {})
        error = internals.group_error(info.get("error"))
        if isinstance(error, kerrors.GroupIdNotFoundError):
            return GroupInfo("Dead", ())
        if error is not None:
            raise error
        members = tuple(_member(m) for m in info.get("members") or [])
        return GroupInfo(str(info.get("group_state") or "Unknown"), members)

    return retrying(describe, f"describing group {group}", kafka, deadline_s)


def _member(raw: Mapping[str, Any]) -> GroupMember:
    return GroupMember(
        client_id=str(raw.get("client_id") or "?"),
        host=str(raw.get("client_host") or "?").lstrip("/"),  # brokers say "/10.0.0.5"
        member_id=str(raw.get("member_id") or ""),
        assignments=tuple(internals.assigned_partitions(raw.get("member_assignment"))),
    )


def commit_group_offsets(
    admin: KafkaAdminClient,
    kafka: KafkaSettings,
    group: str,
    offsets: Mapping[TopicPartition, int],
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> dict[TopicPartition, type[kerrors.KafkaError]]:
    """Commits offsets for a group without joining it; returns the partitions refused.

    The broker takes such a commit only while the group has no members (or does
    not exist yet, which creates it). Retriable errors (the coordinator loading
    or moving) are retried; what is left, e.g. UnknownMemberIdError because a
    member joined, is returned for the caller to explain.
    """
    request = {tp: OffsetAndMetadata(offset, "", -1) for tp, offset in offsets.items()}

    def commit() -> dict[TopicPartition, type[kerrors.KafkaError]]:
        results = admin.alter_group_offsets(group, request)
        refused = {tp: err for tp, err in results.items() if err is not kerrors.NoError}
        # A topic deleted meanwhile is not worth a minute of retries: say so at once.
        retriable = [
            err
            for err in refused.values()
            if err.retriable and err is not kerrors.UnknownTopicOrPartitionError
        ]
        if retriable:
            raise retriable[0]()
        return refused

    return retrying(commit, f"committing offsets of group {group}", kafka, deadline_s)
