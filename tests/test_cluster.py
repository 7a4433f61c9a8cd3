"""The one Kafka layer's retry policy: retriable errors (the coordinator loading or
moving, a broker restarting) are retried with backoff until a deadline; past it,
or on an error no retry mends, one PipelineError a user can act on."""

from __future__ import annotations

import kafka.errors as kerrors
import pytest

from pipeline.core.config import KafkaSettings
from pipeline.core.errors import BrokerUnavailable, PipelineError
from pipeline.kafka import cluster

KAFKA = KafkaSettings(bootstrap_servers="broker-a:9092")


class Flaky:
    """Fails with the given errors, in order, then answers."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "answer"


def test_retriable_errors_are_retried_with_growing_backoff() -> None:
    call = Flaky(
        kerrors.CoordinatorNotAvailableError(),  # a freshly formatted broker
        kerrors.CoordinatorLoadInProgressError(),
        kerrors.NodeNotReadyError(),  # a broker restarting
        kerrors.NotCoordinatorError(),
    )
    sleeps: list[float] = []
    assert cluster.retrying(call, "reading offsets", KAFKA, sleep=sleeps.append) == "answer"
    assert call.calls == 5
    assert sleeps == sorted(sleeps) and sleeps[0] < sleeps[-1]


def test_past_the_deadline_it_is_one_broker_unavailable_line() -> None:
    call = Flaky(*[kerrors.KafkaConnectionError("refused")] * 1000)
    with pytest.raises(BrokerUnavailable) as caught:
        cluster.retrying(call, "reading offsets of group g", KAFKA, deadline_s=0.3)
    message = str(caught.value)
    assert "reading offsets of group g" in message and "broker-a:9092" in message
    assert "\n" not in message
    assert BrokerUnavailable.exit_code not in (0, 1, 2, 3, 4)


def test_an_error_no_retry_mends_is_raised_at_once() -> None:
    call = Flaky(kerrors.GroupAuthorizationFailedError(), kerrors.NodeNotReadyError())
    with pytest.raises(PipelineError, match="not authorised") as caught:
        cluster.retrying(call, "reading offsets", KAFKA, sleep=lambda _: None)
    assert not isinstance(caught.value, BrokerUnavailable)
    assert call.calls == 1
