"""Failpoints: named places where a test run makes the worker pause, to widen a
window that failures must be able to hit (as etcd's gofail does).

Off unless the environment names them: `PIPELINE_FAILPOINTS="name=seconds[,...]"`.
The chaos harness pauses the write stage between a batch's dead letters and its
publish (`write.after_dead_letters`), so that its SIGKILLs and SIGSTOPs land there
often instead of almost never. A name no code knows is refused, one line.
"""

from __future__ import annotations

import os
import time
from functools import cache

from pipeline.core.errors import ConfigError

ENV = "PIPELINE_FAILPOINTS"
KNOWN = frozenset({"write.after_dead_letters"})


@cache
def _pauses(text: str) -> dict[str, float]:
    pauses: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, seconds = item.partition("=")
        if name not in KNOWN:
            raise ConfigError(f"{ENV}: unknown failpoint {name!r} (known: {sorted(KNOWN)})")
        try:
            pauses[name] = float(seconds)
        except ValueError:
            raise ConfigError(f"{ENV}: {item!r} is not name=seconds") from None
    return pauses


def pause(name: str) -> None:
    """Sleeps for the failpoint's seconds where the environment set it; else nothing."""
    seconds = _pauses(os.environ.get(ENV, "")).get(name)
    if seconds:
        time.sleep(seconds)
