"""The one Kafka layer's retry policy: retriable errors (the coordinator loading or
moving, a broker restarting) are retried with backoff until a deadline; past it,
or on an error no retry mends, one PipelineError a user can act on, typed by its
cause (pipeline.kafka.failures)."""

from __future__ import annotations

import socket
import ssl
import time

import kafka.errors as kerrors
import pytest
from kafka import KafkaAdminClient

from pipeline.core.config import KafkaSettings
from pipeline.core.errors import (
    AccessDenied,
    BrokerUnavailable,
    PipelineError,
    SecureConnectionFailed,
)
from pipeline.kafka import cluster, failures

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
    with pytest.raises(AccessDenied, match="reading offsets: not authorised") as caught:
        cluster.retrying(call, "reading offsets", KAFKA, sleep=lambda _: None)
    assert "GroupAuthorizationFailedError" in str(caught.value)
    assert caught.value.exit_code == 77
    assert call.calls == 1


def test_a_tls_failure_worded_as_a_connection_error_is_not_retried() -> None:
    """kafka-python words a certificate it does not trust as a (retriable) connection
    error; no retry mends it."""
    untrusted = ssl.SSLCertVerificationError(1, "certificate verify failed")
    untrusted.verify_code, untrusted.verify_message = 19, "self-signed certificate in chain"
    try:
        raise untrusted
    except ssl.SSLError:
        try:
            raise kerrors.KafkaConnectionError("Handshake failed: ...")
        except kerrors.KafkaConnectionError as worded:
            error = worded
    tls = KafkaSettings(bootstrap_servers="broker-a:9093", security_protocol="SSL")
    call = Flaky(error, kerrors.NodeNotReadyError())
    with pytest.raises(SecureConnectionFailed, match="not trusted") as caught:
        cluster.retrying(call, "reading offsets", tls, sleep=lambda _: None)
    assert "--ssl-cafile" in str(caught.value) and caught.value.exit_code == 76
    assert call.calls == 1


@pytest.mark.parametrize(
    ("error", "typed", "words"),
    [
        (kerrors.SaslAuthenticationFailedError("invalid credentials"), AccessDenied, "user 'u'"),
        (kerrors.UnsupportedSaslMechanismError(), AccessDenied, "SCRAM-SHA-512"),
        (kerrors.IllegalSaslStateError(), SecureConnectionFailed, "does not take SASL"),
        (kerrors.TopicAuthorizationFailedError("a very long request"), AccessDenied, "ACLs"),
        (kerrors.KafkaConnectionError("socket disconnected"), BrokerUnavailable, "did not answer"),
        (kerrors.RequestTimedOutError(), BrokerUnavailable, "did not answer"),
        (kerrors.MessageSizeTooLargeError(), PipelineError, "Kafka refused it"),
    ],
)
def test_a_kafka_python_failure_is_its_typed_error(
    error: Exception, typed: type[PipelineError], words: str
) -> None:
    sasl = KafkaSettings(
        bootstrap_servers="broker-a:9092",
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_plain_username="u",
        sasl_plain_password="secret-password",
    )
    found = failures.from_kafka(error, sasl, "writing dead letters")
    assert type(found) is typed
    line = str(found)
    assert line.startswith("writing dead letters: ") and words in line
    assert "\n" not in line and "secret-password" not in line and "a very long" not in line


def test_a_broker_that_never_answers_is_waited_for_once() -> None:
    """A listener that takes the connection and says nothing: the first contact's
    silence is BrokerUnavailable at once, not again after the clients' bootstrap."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        kafka = KafkaSettings(bootstrap_servers=f"127.0.0.1:{silent.getsockname()[1]}")
        configs = {**cluster.client_kwargs(kafka), "bootstrap_timeout_ms": 2_000}
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="no Kafka broker answered"):
            cluster.build_client(KafkaAdminClient, kafka, **configs)
        assert time.monotonic() - started < 3.5  # 2 s once, not twice
