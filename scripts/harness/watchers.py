"""Threads that watch a running worker from outside: when each record's vector
appears in the output (`Visibility`), and the worker's resident memory
(`RssSampler`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TypeVar

W = TypeVar("W", bound="Watcher")


class Watcher:
    """Calls `_tick()` every `period` seconds on a thread, inside a with-block,
    until the block ends or `_tick()` returns False."""

    period = 1.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self: W) -> W:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.period) and self._tick() is not False:
            pass

    def _tick(self) -> bool | None:
        raise NotImplementedError


class Visibility(Watcher):
    """Watches an output directory; records when each id first appears."""

    period = 0.05

    def __init__(self, output: Path) -> None:
        super().__init__()
        self.vectors = output / "vectors"
        self.seen_at: dict[str, float] = {}
        self._files: set[str] = set()

    def _tick(self) -> None:
        import pyarrow.parquet as pq

        if not self.vectors.is_dir():
            return
        for path in self.vectors.glob("*.parquet"):
            if path.name in self._files:
                continue
            now = time.time()
            self._files.add(path.name)
            for record_id in pq.read_table(path, columns=["id"]).column("id").to_pylist():
                self.seen_at.setdefault(record_id, now)


class RssSampler(Watcher):
    """The worker's resident memory once a second (from /proc), for its growth:
    all of it (VmRSS), and its anonymous part (RssAnon: heaps, arenas, tensors),
    which, unlike pages of mapped libraries (RssFile), cannot be given back
    without freeing. With `smaps_dir`, /proc/PID/smaps is copied there at the
    seconds in `smaps_at`, to diff by mapping where the growth is."""

    def __init__(
        self, pid: int, smaps_dir: Path | None = None, smaps_at: tuple[int, ...] = ()
    ) -> None:
        super().__init__()
        self.proc = Path(f"/proc/{pid}")
        self.samples: list[int] = []  # MB
        self.anon: list[int] = []  # MB
        self.smaps_dir = smaps_dir
        self.smaps_at = set(smaps_at)

    def _tick(self) -> bool:
        try:
            status = (self.proc / "status").read_text()
            if self.smaps_dir is not None and len(self.samples) in self.smaps_at:
                smaps = (self.proc / "smaps").read_text()
                (self.smaps_dir / f"smaps-{len(self.samples):05d}s.txt").write_text(smaps)
        except OSError:
            return False  # the worker has exited
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                self.samples.append(int(line.split()[1]) // 1024)
            elif line.startswith("RssAnon:"):
                self.anon.append(int(line.split()[1]) // 1024)
        return True
