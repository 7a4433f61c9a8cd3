"""Every private part of kafka-python the pipeline touches, in one place.

pyproject pins kafka-python to the release these were read from
(record_batches.MIRRORED_RELEASE); tests/test_kafka_internals.py fails, not skips,
where the installed one lacks any of them. At run time the worker's consumer is
checked once (`check`): a release that lacks any of them is refused in one line
naming each part and what it serves, never run without it.

- `Fetcher.PartitionRecords`: replaced by the batch decoder (record_batches, which
  refuses a kafka-python whose code it does not mirror itself).
- `consumer._coordinator.heartbeat.last_send` and `.received_heartbeat()`, and the
  coordinator's `_process_join_group_response()` and `_process_sync_group_response()`
  (a join answered, with when it was sent): when the group last heard this member
  (the lease under which the write stage sends dead letters and publishes:
  consumers.stages, consumers.dead_letters).
- `consumer._coordinator.reset_generation()` and `.rejoining`: a member the group
  dropped while rejoining gives up its partitions first (`lose_partitions_on_reset`).
- `consumer._fetcher._paused_partition_records` and `._next_partition_records`:
  records parked for a paused partition (priority tiers: `unpark_resumed`).
- `consumer._coordinator.need_rejoin()`: whether the group is rebalancing and this
  member has yet to rejoin (the rebalance line's "the group took": consumers.partitions).
- A failed client's network thread (`NetClients`), one connection outside any client
  (`first_contact`) and the SASL mechanisms' client side (`sasl_authenticator`) for
  the first contact (pipeline.kafka.access), a group's error as kafka-python words
  it (`group_error`), a member's assignment as bytes (`assigned_partitions`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kafka
import kafka.errors as kerrors
from kafka.net.compat import KafkaNetClient
from kafka.net.sasl import get_sasl_mechanism
from kafka.protocol.consumer.metadata import ConsumerProtocolAssignment

from pipeline.core.errors import SetupError
from pipeline.kafka import record_batches

log = logging.getLogger(__name__)

# What each private part serves, as the refusal names it.
_FEATURES = {
    "_coordinator.heartbeat.last_send": "the publish lease",
    "_coordinator.heartbeat.received_heartbeat": "the publish lease",
    "_coordinator._process_join_group_response": "the publish lease",
    "_coordinator._process_sync_group_response": "the publish lease",
    "_coordinator.need_rejoin": "the rebalance log line",
    "_coordinator.reset_generation": "partitions lost when the group drops this member",
    "_coordinator.rejoining": "partitions lost when the group drops this member",
    "_fetcher._paused_partition_records": "priority tiers",
    "_fetcher._next_partition_records": "priority tiers",
    "_fetcher.PartitionRecords": "the batch decoder",
}


def missing(consumer: Any) -> list[str]:
    """The private parts of this consumer's kafka-python that are not as expected."""
    absent = []
    coordinator = getattr(consumer, "_coordinator", None)
    heartbeat = getattr(coordinator, "heartbeat", None)
    if not isinstance(getattr(heartbeat, "last_send", None), float):
        absent.append("_coordinator.heartbeat.last_send")
    if not callable(getattr(heartbeat, "received_heartbeat", None)):
        absent.append("_coordinator.heartbeat.received_heartbeat")
    for name in ("_process_join_group_response", "_process_sync_group_response"):
        if not callable(getattr(coordinator, name, None)):
            absent.append(f"_coordinator.{name}")
    if not callable(getattr(coordinator, "need_rejoin", None)):
        absent.append("_coordinator.need_rejoin")
    if not callable(getattr(coordinator, "reset_generation", None)):
        absent.append("_coordinator.reset_generation")
    if not isinstance(getattr(coordinator, "rejoining", None), bool):
        absent.append("_coordinator.rejoining")
    fetcher = getattr(consumer, "_fetcher", None)
    for name in ("_paused_partition_records", "_next_partition_records", "PartitionRecords"):
        if not hasattr(fetcher, name):
            absent.append(f"_fetcher.{name}")
    return absent


def check(consumer: Any) -> None:
    """Refuses, in one line, a consumer whose kafka-python lacks any part the worker
    relies on (SetupError): the worker never runs without one."""
    absent = missing(consumer)
    if absent:
        raise unsupported(", ".join(f"{name} ({_FEATURES[name]})" for name in absent))


def unsupported(what: str) -> SetupError:
    return SetupError(
        f"kafka-python {kafka.__version__} lacks what the worker relies on: {what}; "
        f"install the release the pipeline is pinned to: "
        f"pip install kafka-python=={record_batches.MIRRORED_RELEASE}"
    )


def track_heartbeats(consumer: Any) -> None:
    """Records, as each heartbeat is answered, when that heartbeat was sent (kafka-python
    keeps only when an answer was read, and `last_reset` moves when the coordinator is
    found again, as after a stall: neither says when the group last heard this member).
    One heartbeat is out at a time, so `last_send` is the answered one's send time.

    A join the group completed counts too, from when its JoinGroup was sent: the
    coordinator starts each member's session as it completes the join, after that
    send. Without it a member that just joined would publish nothing until its first
    heartbeat was answered (up to a heartbeat interval on every start)."""
    coordinator = consumer._coordinator
    heartbeat = coordinator.heartbeat
    answered = heartbeat.received_heartbeat
    joined, synced = (
        coordinator._process_join_group_response,
        coordinator._process_sync_group_response,
    )
    heartbeat.pipeline_heard_at = float("-inf")
    join_sent = [float("-inf")]

    def received() -> None:
        heartbeat.pipeline_heard_at = heartbeat.last_send
        answered()

    def join_answered(response: Any, send_time: float) -> Any:
        join_sent[0] = float("-inf")
        result = joined(response, send_time)  # raises where the join failed
        join_sent[0] = send_time
        return result

    def sync_answered(response: Any, send_time: float) -> Any:
        # Each attempt is a JoinGroup, then its SyncGroup: this one's join is join_sent.
        sent, join_sent[0] = join_sent[0], float("-inf")
        result = synced(response, send_time)  # raises where the sync failed
        heartbeat.pipeline_heard_at = max(heartbeat.pipeline_heard_at, sent)
        return result

    heartbeat.received_heartbeat = received
    coordinator._process_join_group_response = join_answered
    coordinator._process_sync_group_response = sync_answered


def lose_partitions_on_reset(consumer: Any) -> None:
    """Makes a member the group dropped give up its partitions before it joins again.

    kafka-python runs join-prepare, where a member whose generation was reset calls
    `on_partitions_lost` and forgets its partitions, once per rebalance attempt. A
    reset during the attempt (JoinGroup or SyncGroup answered UnknownMemberId or
    IllegalGeneration, as for a worker stalled past its session timeout) skips it:
    the member rejoins claiming its old partitions at generation -1, and the sticky
    assignor may hand them back as kept though another member owned them meanwhile,
    with no callback, so batches polled before the stall would still be published.
    Java's consumer forgets them on the reset (KAFKA-13419); here join-prepare runs
    again, which takes kafka-python's own lost path."""
    coordinator = consumer._coordinator
    reset = coordinator.reset_generation

    def reset_generation(*args: Any, **kwargs: Any) -> None:
        reset(*args, **kwargs)
        coordinator.rejoining = False

    coordinator.reset_generation = reset_generation


def heard_within(consumer: Any, seconds: float) -> bool:
    """Whether a heartbeat the group answered was sent within `seconds`: the lease under
    which the write stage sends dead letters and publishes (consumers.dead_letters).
    The coordinator counts a session from when it got the heartbeat, after it was
    sent, so it cannot have given this member's partitions away before
    `seconds` + (session timeout - `seconds`) have passed. Needs `track_heartbeats`."""
    heard = consumer._coordinator.heartbeat.pipeline_heard_at
    return time.monotonic() - heard <= seconds


def rejoining(consumer: Any) -> bool:
    """Whether the group is rebalancing and this member has yet to rejoin it (False
    where this kafka-python cannot tell)."""
    need_rejoin = getattr(getattr(consumer, "_coordinator", None), "need_rejoin", None)
    try:
        return bool(need_rejoin()) if need_rejoin is not None else False
    except Exception:  # the consumer closed meanwhile
        return False


def unpark_resumed(consumer: Any) -> bool:
    """Works around kafka-python 3.0's port of KAFKA-7548; True when it acted.

    Records fetched for a partition that is then paused are parked, and given
    back once it resumes, but only when the fetcher's in-line slot is empty
    (None). A drained slot is never emptied, and a partition with parked records
    is not fetched either: pausing one tier and not the other could leave a
    resumed backfill partition unread for good. Emptying a drained slot is what
    the fetcher does itself when it parks the slot's partition.
    """
    fetcher = getattr(consumer, "_fetcher", None)
    if not getattr(fetcher, "_paused_partition_records", None):
        return False
    slot = getattr(fetcher, "_next_partition_records", None)
    if slot is None or slot:  # empty already, or records still to hand out
        return False
    fetcher._next_partition_records = None  # type: ignore[union-attr]
    return True


# --------------------------------------------------------------------------- clients


class NetClients:
    """kafka-python's network clients, made for one KafkaConsumer, KafkaProducer or
    KafkaAdminClient (its `kafka_client` factory): kafka-python 3 starts a client's
    network thread before bootstrapping and leaves it running when that fails."""

    def __init__(self) -> None:
        self.made: list[KafkaNetClient] = []

    def __call__(self, **configs: Any) -> KafkaNetClient:
        self.made.append(KafkaNetClient(**configs))
        return self.made[-1]

    def stop(self) -> None:
        for client in self.made:
            try:
                client.close()
                client._net.stop(timeout_ms=1_000)
            except Exception:  # stopping is best effort; the caller's error matters
                log.debug("stopping a failed client's network thread", exc_info=True)


@dataclass(frozen=True)
class Contact:
    """One connection's outcome. `error`: what ended it (None: the broker answered a
    metadata request past every handshake); `answered`: whether it got through TCP,
    TLS, ApiVersions and SASL first; `timed_out`: no outcome within the time given."""

    error: BaseException | None
    answered: bool
    timed_out: bool = False


def first_contact(configs: Mapping[str, Any], timeout_ms: int) -> Contact:
    """Connects to the first bootstrap server in `configs` as a client does (TCP, TLS,
    ApiVersions, SASL), then asks it for metadata: once, without retrying. (A client's
    bootstrap retries every failure until its deadline, then says only that it could
    not bootstrap: the cause is gone.)"""
    client = KafkaNetClient(**configs)
    manager = client._manager
    deadline = time.monotonic() + timeout_ms / 1000
    try:
        node_id = client.cluster.bootstrap_brokers()[0].node_id
        conn = manager.get_connection(
            node_id,
            timeout_ms=timeout_ms,
            pop_on_close=False,
            refresh_metadata_on_err=False,
            reset_backoff_on_connect=False,
        )
        client._net.poll(timeout_ms=timeout_ms, future=conn.init_future)
        if not conn.init_future.is_done:
            return Contact(None, answered=False, timed_out=True)
        if conn.init_future.failed():
            return Contact(conn.init_future.exception, answered=False)
        metadata = manager.call_soon(manager.cluster.refresh_metadata, node_id)
        left_ms = max(0.0, deadline - time.monotonic()) * 1000
        client._net.poll(timeout_ms=left_ms, future=metadata)
        if not metadata.is_done:
            return Contact(None, answered=True, timed_out=True)
        return Contact(metadata.exception, answered=True)
    finally:
        client.close()


def sasl_authenticator(configs: Mapping[str, Any], host: str) -> Any:
    """kafka-python's own client side of the configured SASL mechanism (auth_bytes,
    receive, is_done, is_authenticated), as a connection to `host` would use it."""
    mechanism = get_sasl_mechanism(configs["sasl_mechanism"])
    return mechanism(host=host, **configs)


# --------------------------------------------------------------------------- groups

# kafka-python 3 words a group's error as text: "[Error 69] GroupIdNotFoundError: ...".
_ERROR_CODE = re.compile(r"\[Error (-?\d+)\]")


def group_error(text: str | None) -> kerrors.KafkaError | None:
    """A described group's error (admin.describe_groups' "error") as the KafkaError
    it was, so that a caller can tell what to retry; None when there is none."""
    if not text:
        return None
    code = _ERROR_CODE.match(text)
    error_class = kerrors.for_code(int(code.group(1))) if code else kerrors.KafkaError
    return error_class(text)


def assigned_partitions(raw: Any) -> list[tuple[str, int]]:
    """(topic, partition) pairs of a described member's assignment: decoded by
    kafka-python already, or bytes it could not decode (then tried once more here);
    [] for a protocol other than the consumer's."""
    if isinstance(raw, bytes | bytearray):
        if not raw:
            return []
        try:
            raw = ConsumerProtocolAssignment.decode(bytes(raw))
        except Exception:  # a non-consumer protocol: we cannot tell the owners
            return []
    if hasattr(raw, "to_dict"):
        raw = raw.to_dict()
    if not isinstance(raw, Mapping):
        return []
    pairs = []
    for entry in raw.get("assigned_partitions") or []:
        if isinstance(entry, Mapping):
            topic, partitions = entry.get("topic"), entry.get("partitions") or []
        else:
            topic, partitions = entry
        pairs.extend((topic, int(p)) for p in partitions)
    return sorted(pairs)
