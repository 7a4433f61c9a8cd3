"""Recent samples per partition, kept between refreshes so that verdicts see a trend."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.status.verdicts import Point

Key = tuple[str, int]


class StatusHistory:
    """Recent samples of (committed, end) per partition, kept between refreshes.

    In memory for `--watch`; `save`/`load` persist it to a small JSON file so
    that separate `pipeline status` runs (cron, health checks) can judge trends.
    """

    def __init__(
        self,
        window_seconds: float = 600.0,
        max_samples: int = 30,
        stall_after_seconds: float = 30.0,
        group: str | None = None,
    ) -> None:
        self.window_seconds = window_seconds
        self.max_samples = max(2, max_samples)
        self.stall_after_seconds = stall_after_seconds
        self.group = group
        self.samples: list[tuple[float, dict[Key, tuple[int | None, int]]]] = []

    def add(self, when: float, offsets: Mapping[Key, tuple[int | None, int]]) -> None:
        """Appends a sample and forgets those that left the window."""
        self.samples.append((when, dict(offsets)))
        self.samples.sort(key=lambda sample: sample[0])
        horizon = self.samples[-1][0] - self.window_seconds
        # Keep at least two samples whatever their age: a trend needs two.
        while len(self.samples) > 2 and (
            len(self.samples) > self.max_samples or self.samples[0][0] < horizon
        ):
            self.samples.pop(0)

    def points(self, topic: str, partition: int) -> list[Point]:
        key = (topic, partition)
        return [Point(when, *offsets[key]) for when, offsets in self.samples if key in offsets]

    def span_seconds(self) -> float:
        return self.samples[-1][0] - self.samples[0][0] if self.samples else 0.0

    def clear(self) -> None:
        self.samples.clear()

    def for_group(self, group: str) -> StatusHistory:
        """This history, emptied first if it holds another group's samples."""
        if self.group not in (None, group):
            self.clear()  # samples of another group say nothing about this one
        self.group = group
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "window_seconds": self.window_seconds,
            "max_samples": self.max_samples,
            "stall_after_seconds": self.stall_after_seconds,
            "samples": [
                {
                    "time": when,
                    "offsets": {f"{t}:{p}": list(value) for (t, p), value in offsets.items()},
                }
                for when, offsets in self.samples
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StatusHistory:
        history = cls(
            window_seconds=float(data.get("window_seconds", 600.0)),
            max_samples=int(data.get("max_samples", 30)),
            stall_after_seconds=float(data.get("stall_after_seconds", 30.0)),
            group=data.get("group"),
        )
        for sample in data.get("samples", []):
            offsets = {}
            for name, (committed, end) in sample["offsets"].items():
                topic, _, partition = name.rpartition(":")
                offsets[(topic, int(partition))] = (committed, int(end))
            history.add(float(sample["time"]), offsets)
        return history

    def save(self, path: Path) -> None:
        # Write aside and rename so that a reader never sees half a file.
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict()), encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, **defaults: Any) -> StatusHistory:
        """Reads a saved history; a missing or unreadable file gives an empty one."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls.from_dict(data)
        except (OSError, ValueError, KeyError, TypeError):
            return cls(**defaults)
