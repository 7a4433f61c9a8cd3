"""Dead-letter sink: bad records go to a Kafka topic with their context.

Each dead-letter record keeps the original key and value bytes unchanged and
carries six UTF-8 headers naming the failure and the source position. `send()`
returns only once the broker has acknowledged every record (acks=all, flushed),
because the committer commits past a bad record right after.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kafka import KafkaProducer
from kafka.errors import KafkaError

from pipeline.core.config import KafkaSettings
from pipeline.core.errors import BrokerUnavailable
from pipeline.core.records import BadRecord

log = logging.getLogger(__name__)


def dead_letter_headers(bad: BadRecord) -> list[tuple[str, bytes]]:
    src = bad.source
    return [
        ("error.stage", bad.stage.encode()),
        ("error.class", bad.error_class.encode()),
        ("error.message", bad.message.encode("utf-8", "replace")),
        ("source.topic", src.topic.encode()),
        ("source.partition", str(src.partition).encode()),
        ("source.offset", str(src.offset).encode()),
    ]


class DeadLetterSink:
    def __init__(self, kafka: KafkaSettings, topic: str, timeout_s: float = 30.0) -> None:
        self.topic = topic
        self._timeout_s = timeout_s
        self._producer: KafkaProducer | None = None
        self._kafka = kafka
        self.sent = 0

    def _client(self) -> KafkaProducer:
        # Created on first use: most runs never see a bad record.
        if self._producer is None:
            self._producer = KafkaProducer(
                acks="all",
                linger_ms=5,
                enable_idempotence=True,
                max_request_size=16 * 1024 * 1024,
                # Through a broker restart the producer retries on its own, as long
                # as the worker is willing to wait (--broker-timeout-s).
                delivery_timeout_ms=int(self._timeout_s * 1000),
                **self._kafka.client_kwargs(),
            )
        return self._producer

    def send(self, records: Sequence[BadRecord]) -> None:
        if not records:
            return
        producer = self._client()
        try:
            futures = [
                producer.send(
                    self.topic,
                    key=bad.source.key,
                    value=bad.source.value,
                    headers=dead_letter_headers(bad),
                )
                for bad in records
            ]
            producer.flush(timeout=self._timeout_s)
            for future in futures:
                future.get(timeout=self._timeout_s)
        except KafkaError as exc:
            raise BrokerUnavailable(
                f"could not write {len(records)} record(s) to dead-letter topic {self.topic}: {exc}"
            ) from exc
        self.sent += len(records)
        for bad in records:
            log.warning(
                "dead-lettered %s[%d]@%d: %s: %s",
                bad.source.topic,
                bad.source.partition,
                bad.source.offset,
                bad.error_class,
                bad.message,
            )

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(timeout=self._timeout_s)
            self._producer = None
