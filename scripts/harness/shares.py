"""Where a benchmark run's time goes: the raw model's tokenizing against its forward
passes, and the worker's stages and CPU from its last line (consumers.summary)."""

from __future__ import annotations

import re

_TIME_SPENT = re.compile(
    r"time in stages: embed (?P<embed>[\d.]+)s, write (?P<write>[\d.]+)s, "
    r"commit (?P<commit>[\d.]+)s; CPU: worker (?P<cpu>[\d.]+)s, "
    r"tokenizer processes (?P<tokenizer_cpu>[\d.]+)s"
    r"(?:, engine processes (?P<engine_cpu>[\d.]+)s)?"
)


def time_spent(done_line: str, busy_seconds: float) -> dict[str, float]:
    """The worker's time in stages and CPU seconds per busy second (its done: line)."""
    found = _TIME_SPENT.search(done_line)
    if found is None or busy_seconds <= 0:
        return {}
    return {
        f"d_{k}": float(v) / busy_seconds for k, v in found.groupdict().items() if v is not None
    }


def render_shares(shares: dict[str, float]) -> list[str]:
    """Where the time goes, as shares of (d)'s busy seconds (first record to last
    commit) and of (a)'s seconds."""
    lines = ["where the time goes:"]
    if "a_tokenize" in shares:
        a = shares["a_tokenize"]
        lines.append(f"  (a) tokenizing {a:.0%}, forward passes and pooling {1 - a:.0%}")
    if "d_embed" in shares:
        lines.append(
            f"  (d) of its busy seconds: embed stage {shares['d_embed']:.0%} (forward passes), "
            f"write {shares['d_write']:.0%}, commit {shares['d_commit']:.0%}; CPU seconds per "
            f"busy second: worker {shares['d_cpu']:.2f}, tokenizer processes "
            f"{shares['d_tokenizer_cpu']:.2f}"
            + (
                f", engine processes {shares['d_engine_cpu']:.2f}"
                if "d_engine_cpu" in shares
                else ""
            )
        )
    return lines
