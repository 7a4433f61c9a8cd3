"""Progress with rate and ETA: a bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("pipeline.core.progress")


def format_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "--:--"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class Progress:
    """Counts done units against a total; rate over the whole run so far."""

    def __init__(
        self,
        label: str,
        total: int | None,
        unit: str = "records",
        stream: TextIO | None = None,
        log_every_s: float = 10.0,
        enabled: bool = True,
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self._stream = stream or sys.stderr
        self._tty = enabled and self._stream.isatty()
        self._enabled = enabled
        self._log_every_s = log_every_s
        self._started = time.monotonic()
        self._last_draw = self._started
        self._logged: int | None = None  # `done` at the last log line (not a tty)

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self._started
        return self.done / elapsed if elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        if self.total is None or self.rate <= 0:
            return None
        return max(0, self.total - self.done) / self.rate

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if not self._enabled:
            return
        if self._tty and now - self._last_draw >= 0.2:
            self._stream.write("\r" + self.line(bar=True))
            self._stream.flush()
            self._last_draw = now
        elif not self._tty and now - self._last_draw >= self._log_every_s:
            self._log()
            self._last_draw = now

    def advance(self, count: int) -> None:
        self.update(self.done + count)

    def close(self) -> None:
        if not self._enabled:
            return
        if self._tty:
            self._stream.write("\r" + self.line(bar=True) + "\n")
            self._stream.flush()
        elif self._logged != self.done:  # the same line twice says nothing new
            self._log()

    def _log(self) -> None:
        log.info("%s", self.line(bar=False))
        self._logged = self.done

    def line(self, bar: bool) -> str:
        elapsed = format_duration(time.monotonic() - self._started)
        rate = f"{self.rate:,.0f} {self.unit}/s"
        if self.total:
            share = min(1.0, self.done / self.total)
            meter = ""
            if bar:
                width = 30
                filled = int(share * width)
                meter = "[" + "#" * filled + "." * (width - filled) + "] "
            return (
                f"{self.label}: {meter}{self.done:,}/{self.total:,} {self.unit} "
                f"({share:5.1%}) {rate}, elapsed {elapsed}, ETA {format_duration(self.eta_s)}"
            )
        return f"{self.label}: {self.done:,} {self.unit}, {rate}, elapsed {elapsed}"
