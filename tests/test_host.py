"""call_on_fresh_thread: the result or the exception of a call made on another thread."""

from __future__ import annotations

import threading

import pytest

from pipeline.errors import ModelError
from pipeline.host import call_on_fresh_thread


def test_returns_the_result_of_a_call_made_on_another_thread() -> None:
    caller = threading.get_ident()
    ran_on = call_on_fresh_thread(threading.get_ident, name="probe")
    assert ran_on != caller


def test_raises_the_calls_exception_in_the_caller() -> None:
    def fail() -> None:
        raise ModelError("no such model")

    with pytest.raises(ModelError, match="no such model"):
        call_on_fresh_thread(fail)


def test_the_thread_is_gone_afterwards() -> None:
    before = threading.active_count()
    call_on_fresh_thread(lambda: None)
    assert threading.active_count() == before
