"""Flow control: how the poll loop batches records, when partitions pause, and which
batch is embedded next. The poll loop (consumers.worker) asks a strategy and does
not know which one it runs:

- `FlowControl`: one batcher; every owned partition pauses while `--max-in-flight`
  batches are between poll and commit; batches are embedded in the order they close.
- `TieredFlowControl` (`--backfill-topic`): nearline topics before backfill ones
  (consumers.tiers says how): a batcher and in-flight slots per tier, backfill
  paused while nearline has lag, nearline batches first in the embed queue.

Neither touches the commit protocol: offsets commit only past durable outputs,
whatever is paused or reordered here.
"""

from __future__ import annotations

import collections
import queue
from collections.abc import Callable, Iterator
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from consumers.batcher import Batcher, CloseReason, MicroBatch, TopicPartitionKey
from consumers.partitions import InFlight, Reader
from consumers.tiers import (
    BACKFILL,
    NEARLINE,
    FairShare,
    TieredBatcher,
    TierQueue,
    Tiers,
    batch_is_backfill,
    fetch_lag,
    partition_lags,
)
from pipeline.core.config import WorkerConfig
from pipeline.core.metrics import WorkerMetrics
from pipeline.core.records import Source
from pipeline.kafka.internals import unpark_resumed

# Whether the given partitions (None: every assigned one) have nothing more to fetch now.
CaughtUp = Callable[[set[TopicPartition] | None], bool]


class FlowControl:
    """Plain flow control (the module's docstring)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.batcher: Batcher | TieredBatcher = Batcher(
            config.batching.batch_size,
            config.batching.max_batch_tokens,
            config.batching.poll_timeout_ms / 1000,
            max_bytes=config.batching.max_batch_bytes,
        )
        # One batch more than may be in flight: the embed stage takes the next at once.
        self.embed_queue: queue.Queue[MicroBatch] = queue.Queue(
            maxsize=config.batching.max_in_flight + 1
        )
        # A poll's record cap (None: the consumer's max_poll_records).
        self.poll_records: int | None = None
        # The committed offset's metadata of a partition (None: none).
        self.commit_metadata: Callable[[TopicPartitionKey], str] | None = None

    def attach(self, embed_stage: Any) -> None:
        """Hooks into the embed stage (the tiered strategy measures backfill's rate)."""

    def count_polled(self, sources: list[Source], metrics: WorkerMetrics) -> None:
        """Metrics of a poll's records."""

    def pause(
        self, consumer: KafkaConsumer, reader: Reader, in_flight: InFlight, metrics: WorkerMetrics
    ) -> int:
        """Pauses and resumes partitions; returns how many are paused."""
        return reader.set_paused(len(in_flight) >= self.config.batching.max_in_flight)

    def caught_up_batches(
        self, assignment: set[TopicPartition], caught_up: CaughtUp
    ) -> Iterator[MicroBatch]:
        """The open batch, closed, where it holds all there is to read for now:
        waiting for it to fill would only add latency."""
        if self.batcher.is_open and caught_up(None):
            batch = self.batcher.flush(CloseReason.CAUGHT_UP)
            assert batch is not None
            yield batch


class TieredFlowControl(FlowControl):
    """Priority tiers: nearline topics first, backfill topics after (consumers.tiers)."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.tiers = Tiers(
            config.input.backfill_topics,
            config.batching.backfill_batch_ms / 1000,
            config.batching.batch_size,
        )
        batcher = TieredBatcher.around(self.tiers, self.batcher)
        # Nearline batches go first; each tier has --max-in-flight (see pause).
        inbox = TierQueue(2 * config.batching.max_in_flight + 1, batch_is_backfill(self.tiers))
        # A nearline batch closes only once the one before it is being embedded.
        batcher.hold_nearline = inbox.nearline_waiting
        self.batcher, self.embed_queue = batcher, inbox
        self.commit_metadata = self.tiers.commit_metadata
        self.fair = FairShare()

    def attach(self, embed_stage: Any) -> None:
        embed_stage.on_embedded = self.tiers.embedded  # sizes backfill batches
        # A backfill batch gives way to nearline ones between its forward passes.
        assert isinstance(self.embed_queue, TierQueue)
        embed_stage.yields = batch_is_backfill(self.tiers)
        embed_stage.urgent = self.embed_queue.take_nearline

    def count_polled(self, sources: list[Source], metrics: WorkerMetrics) -> None:
        taken = collections.Counter(
            (s.topic, s.partition) for s in sources if s.topic in self.tiers.backfill_topics
        )
        for key, records in taken.items():
            self.fair.took(key, records)
        backfill = sum(taken.values())
        metrics.tier_records.labels(BACKFILL).inc(backfill)
        metrics.tier_records.labels(NEARLINE).inc(len(sources) - backfill)

    def pause(
        self, consumer: KafkaConsumer, reader: Reader, in_flight: InFlight, metrics: WorkerMetrics
    ) -> int:
        """Backfill waits while nearline has lag (with hysteresis, consumers.tiers);
        each tier pauses at --max-in-flight batches of its own out (a trickle's small
        nearline batches must not take the backfill's slots). Reconciled with the
        consumer's own paused set before every poll, so the pauses hold on whatever
        a rebalance assigned."""
        assert isinstance(self.batcher, TieredBatcher)
        tiers, limit = self.tiers, self.config.batching.max_in_flight
        nearline, backfill = tiers.split(consumer.assignment())
        lag = fetch_lag(consumer, nearline)
        pauses_before = tiers.pauses
        waiting = tiers.observe(lag)
        backfill_out = in_flight.count(tiers.holds_backfill)
        nearline_out = len(in_flight) - backfill_out
        # Backfill batches (and polls while backfill is read) hold about
        # --backfill-batch-ms of embedding, unless no nearline partition is ours.
        records = tiers.backfill_records() if nearline else self.config.batching.batch_size
        wanted: set[TopicPartition] = set()
        if waiting or backfill_out >= limit:
            wanted |= backfill
        else:
            # A partition whose fetch kafka-python has not handed out yet has no known
            # lag; it may hold records, and only pausing the others lets them through.
            lags = {tp: 1 for tp in backfill} | partition_lags(consumer, backfill)
            wanted |= self.fair.ahead(lags, records)
        if nearline_out >= limit:
            wanted |= nearline
        paused = reader.pause_only(wanted)
        unpark_resumed(consumer)
        self.batcher.backfill.max_records = records
        self.poll_records = records if backfill - wanted else None
        metrics.tier_of = tiers.tier_of  # labels the partition lag series
        metrics.nearline_lag.set(lag)
        metrics.backfill_waiting.set(int(waiting))
        metrics.backfill_pauses.inc(tiers.pauses - pauses_before)
        metrics.backfill_batch_records.set(records)
        actual = set(consumer.paused())  # what the consumer holds, not what we asked
        for tier, owned in ((NEARLINE, nearline), (BACKFILL, backfill)):
            metrics.tier_partitions.labels(tier, "paused").set(len(owned & actual))
            metrics.tier_partitions.labels(tier, "reading").set(len(owned - actual))
        return paused

    def caught_up_batches(
        self, assignment: set[TopicPartition], caught_up: CaughtUp
    ) -> Iterator[MicroBatch]:
        """Each tier's open batch closes once that tier's partitions are caught up."""
        assert isinstance(self.batcher, TieredBatcher)
        nearline, backfill = self.tiers.split(assignment)
        for batcher, owned in (
            (self.batcher.nearline, nearline),
            (self.batcher.backfill, backfill),
        ):
            if batcher is self.batcher.nearline and self.batcher.hold_nearline():
                continue  # the previous nearline batch still waits: this one grows
            if batcher.is_open and caught_up(owned):
                batch = batcher.flush(CloseReason.CAUGHT_UP)
                assert batch is not None
                yield batch


def flow_control(config: WorkerConfig) -> FlowControl:
    return TieredFlowControl(config) if config.input.backfill_topics else FlowControl(config)
