"""Bulk mode (`--until-end`): the end offsets taken at start, and whether the whole
group's commits (any worker's) have reached them; they also drive the progress bar."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kafka import TopicPartition

from consumers.startup import remaining_to
from pipeline.core.config import WorkerConfig
from pipeline.core.errors import BrokerUnavailable
from pipeline.core.progress import Progress
from pipeline.kafka import cluster

log = logging.getLogger(__name__)


class BulkEnd:
    def __init__(
        self,
        config: WorkerConfig,
        targets: dict[TopicPartition, int],
        progress: Progress | None,
        check_health: Callable[[float | None, str], None],
    ) -> None:
        """`check_health(failing_since, what)` raises once the cluster failed too long."""
        self.config = config
        self.targets = targets
        self.progress = progress
        self._check_health = check_health
        self._failing_since: float | None = None

    def reached(self, admin: Any, next_offsets: Mapping[tuple[str, int], int]) -> bool:
        """Whether the group's commits reached the targets, where this worker's own
        positions (`next_offsets`) have: its outputs may hold less than the commits say."""
        for key, offset in next_offsets.items():
            target = self.targets.get(TopicPartition(*key))
            if target is not None and offset < target:
                return False
        committed = self._group_committed(admin)
        return committed is not None and remaining_to(self.targets, committed) == 0

    def _group_committed(self, admin: Any) -> dict[TopicPartition, int] | None:
        try:
            committed = cluster.group_offsets(
                admin, self.config.kafka, self.config.group, deadline_s=5.0
            )
        except BrokerUnavailable as exc:
            if self._failing_since is None:
                self._failing_since = time.monotonic()
            log.warning("bulk mode: %s (retrying)", exc)
            self._check_health(self._failing_since, "reading the group's offsets")
            return None
        self._failing_since = None
        if self.progress is not None and self.progress.total is not None:
            # The bar's total is what remained at start.
            self.progress.update(self.progress.total - remaining_to(self.targets, committed))
        return committed

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
