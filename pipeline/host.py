"""Running a call on a short-lived thread of its own, for where torch work runs.

libgomp (torch's OpenMP on the CPU) gives each thread that runs parallel ops a
team of pool threads for the rest of that thread's life. Once it manages more
threads than there are cores, it stops spin-waiting between parallel regions and
every region pays futex wake-ups: forward passes on the worker's embed thread ran
10% slower on 2 cores after the model had been loaded on the main thread. A call
made here runs on a thread that exits afterwards, taking its team with it, so
the thread that embeds later has the only one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def call_on_fresh_thread(fn: Callable[[], T], name: str = "fresh") -> T:
    """fn() on a new thread, joined; its exception, if any, is raised here."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
