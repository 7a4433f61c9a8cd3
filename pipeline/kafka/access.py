"""How clients reach a cluster: the TLS context, and a first contact that names a
wrong credential or certificate in one line, at once.

A kafka-python client retries every failed bootstrap until its deadline, then says
only that it could not bootstrap: a wrong password, an untrusted certificate or a
plaintext client at a TLS port would all read as "no broker answered", seconds
later. So before the first client of a configuration (per process), `check` makes
one connection to each bootstrap server in turn (internals.first_contact) until one
answers: a failure no retry mends is raised as its typed error (failures); a broker
that is down or refuses connections is left to the clients' own bootstrap, which
retries it and says so (BrokerUnavailable, exit 69); one that takes the connection
and says nothing until the deadline is BrokerUnavailable at once (the bootstrap
would wait as long again).

A listener that closes the connection without a word is told apart from a broker
going away by asking it, outside kafka-python, what it speaks and which SASL
mechanisms it enables (pipeline.kafka.listener).
"""

from __future__ import annotations

import logging
import ssl
import time
from typing import Any

import kafka.errors as kerrors

from pipeline.core.config import KafkaSettings
from pipeline.core.errors import AccessDenied, PipelineError, SecureConnectionFailed, SetupError
from pipeline.kafka import failures, internals, listener

log = logging.getLogger(__name__)

TLS_PROTOCOLS = ("SSL", "SASL_SSL")
# Configurations whose first contact went through (in this process).
_passed: set[KafkaSettings] = set()
# A second look at a listener that answered and then hung up, after a broker that
# was going away has gone.
_SECOND_LOOK_S = 0.3
_HUNG_UP = "answered, then closed the connection"
_SILENT = "no answer in time"


def connection_configs(kafka: KafkaSettings) -> dict[str, Any]:
    """kafka-python's connection settings: KafkaSettings.client_kwargs with the TLS
    files loaded here, once per client (`tls_context`)."""
    configs = kafka.client_kwargs()
    context = tls_context(kafka)
    if context is not None:
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_password"):
            configs.pop(name, None)
        configs["ssl_context"] = context
    return configs


def tls_context(kafka: KafkaSettings) -> ssl.SSLContext | None:
    """The client's TLS context (None without TLS), as kafka-python would build it,
    but a file that cannot be used is one SetupError line here, and an encrypted key
    without --ssl-password never makes OpenSSL prompt on the terminal."""
    if kafka.security_protocol not in TLS_PROTOCOLS:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = True
    if kafka.ssl_cafile:
        try:
            context.load_verify_locations(kafka.ssl_cafile)
        except (ssl.SSLError, OSError) as exc:
            raise SetupError(
                f"--ssl-cafile {kafka.ssl_cafile} holds no CA certificate (PEM) ({exc})"
            ) from exc
    else:
        context.load_default_certs()
    if kafka.ssl_certfile:
        _load_client_certificate(context, kafka)
    return context


def _load_client_certificate(context: ssl.SSLContext, kafka: KafkaSettings) -> None:
    asked: list[bool] = []

    def password() -> str:
        asked.append(True)  # the key is encrypted
        return kafka.ssl_password or ""

    key = kafka.ssl_keyfile or kafka.ssl_certfile
    try:
        context.load_cert_chain(kafka.ssl_certfile or "", kafka.ssl_keyfile, password=password)
    except (ssl.SSLError, OSError) as exc:
        if asked and kafka.ssl_password is None:
            message = f"the client key {key} is encrypted: give its password (--ssl-password)"
        elif asked:
            message = (
                f"the client key {key} cannot be decrypted with --ssl-password (wrong password?)"
            )
        elif getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":
            message = f"the client key {key} is not the key of --ssl-certfile {kafka.ssl_certfile}"
        else:
            message = (
                f"--ssl-certfile {kafka.ssl_certfile} and --ssl-keyfile {key} do not hold a "
                f"PEM certificate and its private key ({exc})"
            )
        raise SetupError(message) from exc


def check(kafka: KafkaSettings, timeout_ms: int) -> None:
    """Raises the typed error of a first contact that failed for good; returns once a
    bootstrap server answered, or when none did (the clients then retry and say so)."""
    if kafka in _passed:
        return
    configs = connection_configs(kafka)
    configs.pop("bootstrap_timeout_ms", None)
    servers = [s.strip() for s in kafka.bootstrap_servers.split(",") if s.strip()]
    ends = time.monotonic() + timeout_ms / 1000
    silent = 0
    for n, server in enumerate(servers):
        # Each server its share of the time left: one that does not answer must not
        # leave none for the others.
        deadline = time.monotonic() + (ends - time.monotonic()) / (len(servers) - n)
        failure = _contact(server, {**configs, "bootstrap_servers": [server]}, kafka, deadline)
        if failure is None:
            _passed.add(kafka)
            return
        if isinstance(failure, PipelineError):
            raise failure
        log.debug("first contact with %s: %s", server, failure)
        silent += failure == _SILENT
    if silent == len(servers):
        # The clients' bootstrap would wait as long again for the same silence.
        raise failures.unreachable(kafka, f"no answer within {timeout_ms / 1000:.0f}s")


def _contact(
    server: str, configs: dict[str, Any], kafka: KafkaSettings, deadline: float
) -> PipelineError | str | None:
    """None when `server` answered; the typed error of a failure for good; else a
    note of what happened (the broker is down, does not answer, ...)."""
    for look in (1, 2):
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            return _SILENT
        contact = internals.first_contact(configs, left_ms)
        # kafka-python words a silent broker as a timeout, or as a connection error
        # when even TCP did not answer: then at the deadline.
        timed_out = isinstance(
            contact.error, kerrors.KafkaTimeoutError | kerrors.RequestTimedOutError
        )
        if contact.timed_out or timed_out or time.monotonic() >= deadline - 0.05:
            return _SILENT
        if contact.error is None:
            return None
        found = _diagnose(server, kafka, contact.error, contact.answered, min(left_ms / 1000, 5.0))
        if found is not _HUNG_UP:
            return found if found is not None else repr(contact.error)
        if look == 1:  # answered, then hung up: a broker going away does that too
            time.sleep(_SECOND_LOOK_S)
    return SecureConnectionFailed(
        f"the broker at {server} answered the handshake, then closed the connection at "
        f"the first request: its listener probably wants SASL (--security-protocol "
        f"SASL_PLAINTEXT or SASL_SSL, not {kafka.security_protocol})"
    )


def _diagnose(
    server: str, kafka: KafkaSettings, error: BaseException, answered: bool, timeout_s: float
) -> PipelineError | str | None:
    """The typed error of a first contact that failed for good; _HUNG_UP where the
    listener answered and then hung up (it may want SASL); None where it cannot be
    told (a broker down or going away)."""
    typed = failures.security_failure(error, kafka, server)
    wrong_mechanism = any(
        isinstance(c, kerrors.UnsupportedSaslMechanismError) for c in failures.causes(error)
    )
    if typed is not None and not wrong_mechanism:
        return typed
    speaks = listener.speaks(server, timeout_s)
    wants_tls = kafka.security_protocol in TLS_PROTOCOLS
    if wants_tls and speaks == "kafka":
        return SecureConnectionFailed(
            f"the listener at {server} does not speak TLS (it answered a plaintext Kafka "
            f"request): --security-protocol {kafka.security_protocol} does not match it "
            "(it is a PLAINTEXT or SASL_PLAINTEXT port)"
        )
    if not wants_tls and speaks == "tls":
        return SecureConnectionFailed(
            f"the listener at {server} speaks TLS: give --security-protocol SSL (or "
            f"SASL_SSL) and --ssl-cafile, not {kafka.security_protocol}"
        )
    sasl = kafka.security_protocol.startswith("SASL")
    if sasl and not answered:
        # kafka-python drops the broker's last answer when the broker hangs up right
        # after it, as it does after refusing a mechanism or credentials: ask again.
        refusal = _sasl_refusal(server, kafka, timeout_s)
        if refusal is not None:
            return refusal
    if typed is not None:
        return typed
    hung_up = isinstance(error, kerrors.KafkaConnectionError)
    if answered and hung_up and speaks and not sasl:
        return _HUNG_UP
    return None


def _sasl_refusal(server: str, kafka: KafkaSettings, timeout_s: float) -> PipelineError | None:
    """The listener's refusal of this client's SASL, asked outside kafka-python; None
    where it took the credentials or could not be asked."""
    host = server.rpartition(":")[0].strip("[]")
    mechanism = str(kafka.sasl_mechanism)
    try:
        authenticator = internals.sasl_authenticator(kafka.client_kwargs(), host)
        answer = listener.sasl_answer(
            server, mechanism, authenticator, tls_context(kafka), timeout_s
        )
    except (kerrors.KafkaError, ImportError, ValueError) as exc:  # a mechanism's own checks
        log.debug("asking %s about SASL: %s", server, exc)
        return None
    if answer is None:
        return None
    if not answer.enabled:
        return SecureConnectionFailed(
            f"the listener at {server} does not take SASL: --security-protocol "
            f"{kafka.security_protocol} does not match it (it is a PLAINTEXT or SSL port)"
        )
    if mechanism not in answer.enabled:
        return AccessDenied(
            f"the broker at {server} does not enable SASL mechanism {mechanism} "
            f"(it enables {', '.join(answer.enabled)}); give one of those (--sasl-mechanism)"
        )
    if answer.refused:
        return failures.authentication_failed(kafka, server)
    return None
