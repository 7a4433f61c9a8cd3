"""Progress lines: rate and ETA on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import io
import logging

import pytest

from pipeline.core import progress as progress_module
from pipeline.core.progress import Progress, format_duration


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_format_duration() -> None:
    assert format_duration(None) == "--:--"
    assert format_duration(65) == "01:05"
    assert format_duration(3725) == "1:02:05"


def test_terminal_bar_shows_share_rate_and_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = _Tty()
    bar = Progress("embedding", 1000, stream=stream)
    now[0] += 10
    bar.update(250)  # 25 records/s, 750 left: ETA 30 s
    out = stream.getvalue()
    assert out.startswith("\r")
    assert "250/1,000 records" in out and "25.0%" in out
    assert "25 records/s" in out and "ETA 00:30" in out
    bar.close()
    assert stream.getvalue().endswith("\n")


def test_not_a_terminal_logs_periodically(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    bar = Progress("producing", None, stream=stream, log_every_s=10)
    with caplog.at_level(logging.INFO, logger="pipeline.core.progress"):
        for step in range(1, 31):
            now[0] = float(step)
            bar.update(step * 100)
    assert stream.getvalue() == ""  # no bar drawn into a pipe or a log file
    lines = [r.getMessage() for r in caplog.records]
    assert 2 <= len(lines) <= 4  # every 10 s, not every update
    assert "3,000 records" in lines[-1] and "100 records/s" in lines[-1]


def test_log_lines_are_periodic_and_the_last_is_not_repeated(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    bar = Progress("producing", None, stream=io.StringIO(), log_every_s=10)
    with caplog.at_level(logging.INFO, logger=progress_module.log.name):
        now[0] += 1
        bar.update(10)  # too soon after the start for a line
        now[0] += 10
        bar.update(500)  # a line
        bar.close()  # nothing new: no second line
        assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
            "500 records, 45 records/s, elapsed 00:11"
        ]
        now[0] += 1
        bar.update(600)
        bar.close()  # news since the last line: one more
    assert len(caplog.records) == 2


def _screen(written: str) -> str:
    """What a terminal shows of a single line redrawn with carriage returns."""
    screen: list[str] = []
    for segment in written.rstrip("\n").split("\r"):
        screen[: len(segment)] = segment
    return "".join(screen).rstrip()


def test_the_bar_says_what_the_log_line_says(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = _Tty()
    bar = Progress("embedding", 1000, stream=stream)
    now[0] += 10
    bar.update(250)
    shown = _screen(stream.getvalue())
    assert shown == (
        "embedding: [#######.......................] 250/1,000 records (25.0%) "
        "25 records/s, elapsed 00:10, ETA 00:30"
    )
    assert shown.replace("[#######.......................] ", "") == bar.line()


def test_a_shorter_line_leaves_nothing_of_the_longer_one(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = _Tty()
    bar = Progress("embedding", 10_000_000, stream=stream)
    now[0] = 10.0
    bar.update(1_000)
    now[0] = 20.0
    bar.update(9_000)  # the ETA loses a digit, nothing else grows
    assert "100 records/s, elapsed 00:10, ETA 27:46:30" in stream.getvalue()
    assert _screen(stream.getvalue()).endswith("450 records/s, elapsed 00:20, ETA 6:10:02")


def test_elapsed_moves_on_the_terminal_without_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = _Tty()
    bar = Progress("producing", None, stream=stream)
    now[0] = 65.0
    bar.update(0)
    assert _screen(stream.getvalue()) == "producing: 0 records, 0 records/s, elapsed 01:05"
    bar.close()
    assert stream.getvalue().endswith("\n")


def test_a_terminal_that_does_not_say_its_width_gets_the_whole_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os
    import sys

    master, slave = os.openpty()  # never sized: 0 columns, as some CI terminals
    with open(slave, "w") as terminal:
        assert os.get_terminal_size(terminal.fileno()).columns == 0
        monkeypatch.setattr(sys, "stderr", terminal)  # where the bar goes
        bar = Progress("producing", None)
        bar.update(10)
        bar.close()
    shown = _drain(master).decode()
    os.close(master)
    assert "producing: 10 records" in shown and "elapsed 00:00" in shown, repr(shown)


def _drain(fd: int) -> bytes:
    """All a pty holds: one read returns one write's worth at times (the first draw
    without the last), so read until nothing more comes."""
    import os
    import select

    data = b""
    while select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the terminal's side is closed and nothing is left
            break
        if not chunk:
            break
        data += chunk
    return data
