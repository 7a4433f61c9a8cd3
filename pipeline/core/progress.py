"""Progress with rate and ETA: a bar on a terminal (tqdm), periodic log lines otherwise.

Both say the same, in one format (tqdm's `format_meter`), the bar only on a terminal:

    embedding: [#######.......................] 250/1,000 records (25.0%) 25 records/s,
        elapsed 00:10, ETA 00:30   (one line)
    producing to t: 3,000 records, 100 records/s, elapsed 00:30

The rate is over the whole run so far.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

log = logging.getLogger("pipeline.core.progress")

_COUNTS = (
    "{n_text}/{total_text} {unit} ({percentage:4.1f}%) {rate_text}, elapsed {elapsed}, ETA {eta}"
)
_UNCOUNTED = "{desc}: {n_text} {unit}, {rate_text}, elapsed {elapsed}"  # no total: no bar
_FORMATS = {  # (a total is known, a bar is drawn): tqdm's bar_format
    (True, True): "{desc}: [{bar:30}] " + _COUNTS,
    (True, False): "{desc}: " + _COUNTS,
    (False, True): _UNCOUNTED,
    (False, False): _UNCOUNTED,
}
_BAR_CHARS = ".#"  # empty, full: [#########.........]
_REDRAW_S = 0.2
_UNCUT = 10_000  # the width of a terminal that does not say its own: nothing is cut


def format_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "--:--"
    return tqdm.format_interval(seconds)


def _columns(stream: TextIO) -> int:
    """The terminal's width (tqdm cuts the line to it, so that it never wraps); a
    pseudo-terminal never sized says 0, and tqdm would then draw nothing."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or _UNCUT
    except (AttributeError, ValueError, OSError):  # not a file, or no terminal behind it
        return _UNCUT


def _fields(n: int, total: int | None, elapsed: float, unit: str) -> dict[str, Any]:
    """What the format adds to tqdm's own fields (thousands separators, a whole-run
    rate, `--:--` for an ETA not known yet)."""
    rate = n / elapsed if elapsed > 0 else 0.0
    eta = max(0, total - n) / rate if total is not None and rate > 0 else None
    return {
        "n_text": f"{n:,}",
        "total_text": f"{total:,}" if total is not None else "?",
        "rate_text": f"{rate:,.0f} {unit}/s",
        "eta": format_duration(eta),
    }


class _Bar(tqdm):
    """tqdm on the progress's clock (time.monotonic, as the log lines), drawing the
    pipeline's format."""

    monitor_interval = 0  # no monitor thread: the bar is redrawn as it is updated

    def __init__(self, label: str, total: int | None, unit: str, stream: TextIO) -> None:
        super().__init__(
            total=total,
            desc=label,
            unit=unit,
            file=stream,
            ncols=_columns(stream),
            nrows=_UNCUT,  # one line: tqdm hides a bar below a height it reads as 0 or less
            position=0,  # its own line, whatever other tqdm bars exist (a model's loading)
            mininterval=_REDRAW_S,
            miniters=0,  # redraw on time alone, so that elapsed moves without progress
            smoothing=0,  # the rate over the whole run, as in the log lines
            ascii=_BAR_CHARS,
            bar_format=_FORMATS[(bool(total), True)],
        )
        # tqdm times itself with time.time; swapped as tqdm's own tests do.
        self._time = lambda: time.monotonic()
        self.start_t = self.last_print_t = self._time()

    @property
    def format_dict(self) -> dict[str, Any]:
        values = super().format_dict
        values.update(_fields(self.n, self.total, values["elapsed"], self.unit))
        return values


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
        stream = stream or sys.stderr
        self._enabled = enabled
        self._log_every_s = log_every_s
        self._started = time.monotonic()
        self._last_log = self._started
        self._logged: int | None = None  # `done` at the last log line
        self._bar = _Bar(label, total, unit, stream) if enabled and stream.isatty() else None

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
        if self._bar is not None:
            self._bar.update(done - self._bar.n)  # redrawn at most every _REDRAW_S
        elif self._enabled and time.monotonic() - self._last_log >= self._log_every_s:
            self._log()

    def advance(self, count: int) -> None:
        self.update(self.done + count)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()  # the last state, and a newline
        elif self._enabled and self._logged != self.done:  # the same line twice says nothing
            self._log()

    def line(self, bar: bool = False) -> str:
        elapsed = time.monotonic() - self._started
        fields = _fields(self.done, self.total, elapsed, self.unit)
        return tqdm.format_meter(
            self.done,
            self.total,
            elapsed,
            prefix=self.label,
            unit=self.unit,
            ascii=_BAR_CHARS,
            bar_format=_FORMATS[(bool(self.total), bar)],
            **fields,
        )

    def _log(self) -> None:
        log.info("%s", self.line())
        self._logged = self.done
        self._last_log = time.monotonic()
