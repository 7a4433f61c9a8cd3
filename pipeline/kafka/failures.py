"""Which typed error a kafka-python failure is, in one line that names its cause.

kafka-python words the failures no retry mends in several ways: a SASL refusal is
a SaslAuthenticationFailedError or UnsupportedSaslMechanismError, SASL against a
listener without it an IllegalSaslStateError, and a TLS failure a
KafkaConnectionError that carries the `ssl` error, as its context (the handshake)
or its argument (a read: the broker's alert about our certificate).
`security_failure` names those; `from_kafka` types any kafka-python exception, for
callers that want one error for whatever the cluster said (the dead-letter
producer, a client's start). Messages name users, mechanisms, files and servers,
never a password.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import kafka.errors as kerrors

from pipeline.core.config import KafkaSettings
from pipeline.core.errors import (
    AccessDenied,
    BrokerUnavailable,
    PipelineError,
    SecureConnectionFailed,
)

# OpenSSL's names for the broker's alerts about this client's certificate (mutual TLS).
_CLIENT_CERTIFICATE_ALERTS = frozenset(
    {
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
        "SSLV3_ALERT_CERTIFICATE_EXPIRED",
        "SSLV3_ALERT_CERTIFICATE_REVOKED",
        "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
        "TLSV1_ALERT_UNKNOWN_CA",
        "TLSV1_ALERT_ACCESS_DENIED",
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
    }
)
# OpenSSL's verify codes for a certificate that does not name the host dialled.
_NAME_MISMATCH = frozenset({62, 64})  # X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_MISMATCH


def security_failure(
    exc: BaseException, kafka: KafkaSettings, server: str | None = None
) -> PipelineError | None:
    """The typed error for a SASL or TLS failure (AccessDenied, SecureConnectionFailed);
    None for any other failure. `server` is the HOST:PORT it happened at."""
    at = server or kafka.bootstrap_servers
    for cause in causes(exc):
        found = _sasl_failure(cause, kafka, at) or _tls_failure(cause, kafka, at)
        if found is not None:
            return found
    return None


def from_kafka(exc: BaseException, kafka: KafkaSettings, what: str | None = None) -> PipelineError:
    """Any kafka-python exception as the PipelineError it is: a security failure as
    above, an ACL refusal AccessDenied, one that retrying might mend (a broker down or
    restarting, a timeout) BrokerUnavailable, any other a PipelineError. `what` names
    the operation ("writing to dead-letter topic t")."""
    doing = f"{what}: " if what else ""
    typed = security_failure(exc, kafka)
    if typed is not None:
        return type(typed)(f"{doing}{typed}")
    if isinstance(exc, kerrors.AuthorizationError):
        return not_authorised(exc, kafka, what)
    if isinstance(exc, kerrors.KafkaError) and exc.retriable:
        return BrokerUnavailable(
            f"{doing}the cluster at {kafka.bootstrap_servers} did not answer ({exc}); "
            "check that the brokers are up and reachable"
        )
    return PipelineError(f"{doing}Kafka refused it ({exc})")


def unreachable(
    kafka: KafkaSettings, exc: BaseException | str | None = None, what: str | None = None
) -> BrokerUnavailable:
    """No broker of `kafka.bootstrap_servers` answered (exit 69)."""
    detail = f" ({exc})" if exc else ""
    doing = f"{what}: " if what else ""
    return BrokerUnavailable(
        f"{doing}no Kafka broker answered at {kafka.bootstrap_servers}{detail}; start one "
        "(scripts/dev-kafka.sh start) or set --bootstrap-servers / PIPELINE_BOOTSTRAP_SERVERS"
    )


def not_authorised(
    exc: kerrors.AuthorizationError, kafka: KafkaSettings, what: str | None = None
) -> AccessDenied:
    # kafka-python's own message repeats the whole request and response.
    doing = f"{what}: " if what else ""
    return AccessDenied(
        f"{doing}not authorised: the cluster refuses it to {principal(kafka)} "
        f"({type(exc).__name__}); grant the ACLs it needs"
    )


def authentication_failed(kafka: KafkaSettings, at: str) -> AccessDenied:
    return AccessDenied(
        f"authentication failed for user {kafka.sasl_plain_username!r} with SASL "
        f"mechanism {kafka.sasl_mechanism} at {at}: the user name or the password is wrong "
        "(--sasl-username, --sasl-password)"
    )


def principal(kafka: KafkaSettings) -> str:
    if kafka.security_protocol.startswith("SASL"):
        return f"user {kafka.sasl_plain_username!r}"
    if kafka.ssl_certfile:
        return f"the client certificate {kafka.ssl_certfile}"
    return "this client (anonymous)"


def causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception, what it was raised from or during, and exceptions it carries as
    arguments (kafka-python wraps a socket's error in KafkaConnectionError(error))."""
    seen: set[int] = set()
    pending = [exc]
    while pending and len(seen) < 16:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending.extend(a for a in current.args if isinstance(a, BaseException))
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def _sasl_failure(cause: BaseException, kafka: KafkaSettings, at: str) -> PipelineError | None:
    mechanism = kafka.sasl_mechanism
    if isinstance(cause, kerrors.SaslAuthenticationFailedError):
        return authentication_failed(kafka, at)
    if isinstance(cause, kerrors.UnsupportedSaslMechanismError):
        return AccessDenied(
            f"the broker at {at} does not enable SASL mechanism {mechanism}; "
            "give one it enables (--sasl-mechanism)"
        )
    if isinstance(cause, kerrors.IllegalSaslStateError):
        return SecureConnectionFailed(
            f"the listener at {at} does not take SASL: --security-protocol "
            f"{kafka.security_protocol} does not match it (it is a PLAINTEXT or SSL port)"
        )
    return None


def _tls_failure(cause: BaseException, kafka: KafkaSettings, at: str) -> PipelineError | None:
    if isinstance(cause, ssl.SSLCertVerificationError):
        return _untrusted_broker(cause, kafka, at)
    if not isinstance(cause, ssl.SSLError) or cause.reason is None:
        return None
    if cause.reason in _CLIENT_CERTIFICATE_ALERTS:
        if not kafka.ssl_certfile:
            return AccessDenied(
                f"the broker at {at} asks for a client certificate (mutual TLS): give "
                "--ssl-certfile and --ssl-keyfile"
            )
        return AccessDenied(
            f"the broker at {at} refused the client certificate {kafka.ssl_certfile} "
            f"({_words(cause.reason)}): it must be signed by a CA the broker trusts"
        )
    if "ALERT" in cause.reason or cause.reason in ("NO_SHARED_CIPHER", "UNSUPPORTED_PROTOCOL"):
        return SecureConnectionFailed(
            f"the TLS handshake with {at} failed ({_words(cause.reason)}): the broker and "
            "this client have no TLS version or cipher in common"
        )
    return None


def _untrusted_broker(
    cause: ssl.SSLCertVerificationError, kafka: KafkaSettings, at: str
) -> SecureConnectionFailed:
    why = cause.verify_message or str(cause)
    if cause.verify_code in _NAME_MISMATCH:
        return SecureConnectionFailed(
            f"the broker's certificate at {at} is not valid for the host name dialled "
            f"({why}); give --bootstrap-servers a name the certificate holds"
        )
    if kafka.ssl_cafile:
        return SecureConnectionFailed(
            f"the broker's certificate at {at} is not trusted ({why}): no CA in "
            f"--ssl-cafile {kafka.ssl_cafile} signed it"
        )
    return SecureConnectionFailed(
        f"the broker's certificate at {at} is not trusted ({why}); give the CA that "
        "signed it with --ssl-cafile"
    )


def _words(reason: str) -> str:
    """OpenSSL's SSLV3_ALERT_BAD_CERTIFICATE as "alert bad certificate"."""
    words = reason.lower().split("_")
    while words and words[0].startswith(("sslv3", "tlsv1")):
        words.pop(0)
    return " ".join(words)
