"""`pipeline status --watch`: the report refreshed every few seconds until Ctrl-C."""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from pipeline.core.config import KafkaSettings
from pipeline.core.errors import ConfigError, PipelineError
from pipeline.status.collect import collect_status
from pipeline.status.history import StatusHistory
from pipeline.status.render import render_table

_CLEAR_HOME = "\x1b[H\x1b[2J"
Collect = Callable[..., dict[str, Any]]


def watch(
    kafka: KafkaSettings,
    group: str,
    interval_s: float,
    topics: Sequence[str] | None = None,
    output: Path | None = None,
    *,
    as_json: bool = False,
    dlq_topic: str | None = None,
    history: StatusHistory | None = None,
    stream: TextIO | None = None,
    max_refreshes: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
    collect: Collect = collect_status,
) -> dict[str, Any] | None:
    """Refreshes the report every `interval_s` seconds until Ctrl-C.

    On a terminal the screen is redrawn in place; otherwise (a pipe, a log)
    reports are appended, JSON ones one per line. The first failure raises (a
    wrong group or broker should fail fast); later ones are shown and retried,
    so that a broker restart does not end the watch. Returns the last report
    (None if interrupted before the first), for the caller's exit code.
    """
    if interval_s <= 0:
        raise ConfigError("--watch needs a positive number of seconds")
    out = stream if stream is not None else sys.stdout
    history = history if history is not None else StatusHistory(group=group)
    in_place = not as_json and out.isatty()
    last: dict[str, Any] | None = None
    refreshes = 0
    try:
        while max_refreshes is None or refreshes < max_refreshes:
            started = time.monotonic()
            try:
                last = collect(kafka, group, topics, output, history, dlq_topic=dlq_topic)
                text = json.dumps(last) if as_json else render_table(last)
            except PipelineError as exc:
                if last is None:
                    raise
                text = f"error: {exc} (retrying every {interval_s:g}s)"
            _show(out, text, in_place, interval_s, as_json)
            refreshes += 1
            if max_refreshes is None or refreshes < max_refreshes:
                sleep(max(0.0, interval_s - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    return last


def _show(out: TextIO, text: str, in_place: bool, interval_s: float, as_json: bool) -> None:
    if as_json:
        out.write(text + "\n")
    else:
        stamp = dt.datetime.now().strftime("%H:%M:%S")
        banner = f"every {interval_s:g}s  {stamp}  (Ctrl-C to stop)"
        out.write((_CLEAR_HOME if in_place else "") + banner + "\n" + text + "\n")
        if not in_place:
            out.write("\n")
    out.flush()
