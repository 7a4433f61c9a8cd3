"""Every private part of kafka-python the pipeline touches, in one place.

pyproject pins kafka-python to the release these were read from
(record_batches.MIRRORED_RELEASE); tests/test_kafka_internals.py fails, not skips,
where the installed one lacks any of them. At run time a consumer is checked once
(`check`): what is missing is named in a warning, and the worker does without it.

- `Fetcher.PartitionRecords`: replaced by the batch decoder (record_batches, which
  checks the mirrored code itself).
- `consumer._coordinator.heartbeat.session_timeout_expired()`: whether the group
  still hears this member (a writer that has not been heard for a session stops
  publishing: consumers.stages).
- `consumer._fetcher._paused_partition_records` and `._next_partition_records`:
  records parked for a paused partition (priority tiers: `unpark_resumed`).
- `consumer._coordinator.need_rejoin()`: whether the group is rebalancing and this
  member has yet to rejoin (the rebalance line's "the group took": consumers.partitions).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def missing(consumer: Any) -> list[str]:
    """The private parts of this consumer's kafka-python that are not as expected."""
    absent = []
    coordinator = getattr(consumer, "_coordinator", None)
    heartbeat = getattr(coordinator, "heartbeat", None)
    if not callable(getattr(heartbeat, "session_timeout_expired", None)):
        absent.append("_coordinator.heartbeat.session_timeout_expired")
    if not callable(getattr(coordinator, "need_rejoin", None)):
        absent.append("_coordinator.need_rejoin")
    fetcher = getattr(consumer, "_fetcher", None)
    for name in ("_paused_partition_records", "_next_partition_records", "PartitionRecords"):
        if not hasattr(fetcher, name):
            absent.append(f"_fetcher.{name}")
    return absent


def check(consumer: Any) -> None:
    import kafka

    for name in missing(consumer):
        log.warning(
            "kafka-python %s has no %s (the pipeline is pinned to the release it was read "
            "from): the worker does without it",
            kafka.__version__,
            name,
        )


def heard_by_group(consumer: Any) -> bool:
    """False once no heartbeat got through for a whole session timeout (True where
    this kafka-python cannot tell: publishing then relies on ownership and the
    create-if-absent alone)."""
    heartbeat = getattr(getattr(consumer, "_coordinator", None), "heartbeat", None)
    expired = getattr(heartbeat, "session_timeout_expired", None)
    return expired is None or not expired()


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
