"""The backfill tier's wait/resume log lines (consumers.tiers.Tiers.observe): one INFO
line per wait that lasts, DEBUG for the short ones a nearline trickle makes."""

from __future__ import annotations

import logging

import pytest

from consumers.tiers import LASTING_WAIT_S, Tiers
from tests.test_tiers import CORPUS, Clock

LOGGER = "consumers.tiers"


def info_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.INFO
    ]


def poll_loop(tiers: Tiers, clock: Clock, lag: int, seconds: float, step: float = 0.1) -> None:
    """The poll loop's turns for `seconds`, each seeing `lag` nearline records."""
    for _ in range(round(seconds / step)):
        tiers.observe(lag)
        clock.now += step


def test_a_trickle_of_nearline_records_logs_no_info_line_per_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    clock = Clock()
    tiers = Tiers([CORPUS], 1.0, 4096, clock=clock)
    records = 200
    for _ in range(records):  # one record every ~2 s: a wait and a resume each
        poll_loop(tiers, clock, lag=1, seconds=0.3)
        poll_loop(tiers, clock, lag=0, seconds=1.7)
    assert tiers.pauses == records
    assert not info_lines(caplog)
    debug = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.DEBUG]
    assert len(debug) == 2 * records  # the details are still there for --log-level DEBUG


def test_a_wait_that_lasts_logs_one_info_line_as_it_starts_to_last_and_one_as_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    clock = Clock()
    tiers = Tiers([CORPUS], 1.0, 4096, clock=clock)
    for _ in range(3):  # short waits first: counted in the next INFO line
        poll_loop(tiers, clock, lag=1, seconds=0.5)
        poll_loop(tiers, clock, lag=0, seconds=1.5)
    poll_loop(tiers, clock, lag=50, seconds=LASTING_WAIT_S + 20)  # nearline far behind
    poll_loop(tiers, clock, lag=0, seconds=2)
    assert tiers.waiting is False
    lines = info_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0] == (
        "backfill waits: nearline lag 50 for 10s; 3 shorter waits since the last such line"
    )
    assert lines[1].startswith("backfill resumes: nearline caught up (it waited 31.")


def test_info_lines_stay_bounded_whatever_the_mix_of_short_and_long_waits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = Clock()
    tiers = Tiers([CORPUS], 1.0, 4096, clock=clock)
    long_waits = 5
    for _ in range(long_waits):
        for _ in range(50):
            poll_loop(tiers, clock, lag=2, seconds=0.2)
            poll_loop(tiers, clock, lag=0, seconds=1.2)
        poll_loop(tiers, clock, lag=2, seconds=LASTING_WAIT_S + 1)
        poll_loop(tiers, clock, lag=0, seconds=1.2)
    assert tiers.pauses == long_waits * 51
    assert len(info_lines(caplog)) == 2 * long_waits
