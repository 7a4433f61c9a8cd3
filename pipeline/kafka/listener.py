"""What a Kafka listener speaks, asked outside kafka-python, for the first contact's
diagnosis (pipeline.kafka.access) when a listener hung up on a client without a word.

Requests a listener answers before any authentication, in the protocol's own bytes:
ApiVersions v0, which a TLS listener answers with a TLS alert; SaslHandshake v1,
whose answer lists the SASL mechanisms the listener enables (or says it takes no
SASL); and SaslAuthenticate v1 (KIP-152), whose answer says whether it took the
credentials.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_API_VERSIONS, _SASL_HANDSHAKE, _AUTHENTICATE = 18, 17, 36
_ILLEGAL_SASL_STATE = 34
_CORRELATION_ID = 0x7E57
_CLIENT_ID = b"embedding-pipeline-probe"
_MAX_RESPONSE = 64 * 1024


def speaks(server: str, timeout_s: float) -> str | None:
    """'kafka' where `server` answers a plaintext ApiVersions request, 'tls' where it
    answers with a TLS record (a TLS listener's alert), None otherwise."""
    try:
        with _connected(server, None, timeout_s) as sock:
            answer = _ask(sock, _request(_API_VERSIONS, 0, b""))
    except (OSError, ValueError):
        return None
    if len(answer) >= 2 and answer[0] in (0x15, 0x16) and answer[1] == 0x03:
        return "tls"  # an alert or a handshake record, TLS 1.x
    if len(answer) >= 8 and struct.unpack_from(">i", answer, 4)[0] == _CORRELATION_ID:
        return "kafka"
    return None


@dataclass(frozen=True)
class SaslAnswer:
    """What a listener said to a SASL handshake and authentication."""

    enabled: tuple[str, ...]  # the mechanisms it enables; () where it takes no SASL
    refused: bool = False  # it refused the credentials


def sasl_answer(
    server: str,
    mechanism: str,
    authenticator: Any,
    context: ssl.SSLContext | None,
    timeout_s: float,
) -> SaslAnswer | None:
    """Asks the listener at `server` for SASL `mechanism` (SaslHandshake v1) and, where
    it enables it, authenticates with `authenticator` (SaslAuthenticate v1; a
    kafka-python mechanism: internals.sasl_authenticator), reading every answer to
    its end (kafka-python drops an answer the broker hangs up right after). None
    where it did not answer. `context`: TLS first (SASL_SSL)."""
    name = mechanism.encode()
    try:
        with _connected(server, context, timeout_s) as sock:
            answer = _ask(sock, _request(_SASL_HANDSHAKE, 1, struct.pack(">h", len(name)) + name))
            error_code, enabled = _handshake(answer)
            if error_code == _ILLEGAL_SASL_STATE or mechanism not in enabled:
                return SaslAnswer(() if error_code == _ILLEGAL_SASL_STATE else enabled)
            while not authenticator.is_done():
                token = authenticator.auth_bytes()
                body = struct.pack(">i", len(token)) + token
                error_code, auth_bytes = _authenticated(
                    _ask(sock, _request(_AUTHENTICATE, 1, body))
                )
                if error_code:
                    return SaslAnswer(enabled, refused=True)
                authenticator.receive(auth_bytes)
            return SaslAnswer(enabled, refused=not authenticator.is_authenticated())
    except (OSError, ValueError, struct.error):
        return None


def _handshake(answer: bytes) -> tuple[int, tuple[str, ...]]:
    if struct.unpack_from(">i", answer, 4)[0] != _CORRELATION_ID:
        raise ValueError("not an answer to this request")
    error_code, count = struct.unpack_from(">hi", answer, 8)
    mechanisms, at = [], 14
    for _ in range(max(0, count)):
        (size,) = struct.unpack_from(">h", answer, at)
        mechanisms.append(answer[at + 2 : at + 2 + size].decode("utf-8", "replace"))
        at += 2 + size
    return error_code, tuple(mechanisms)


def _authenticated(answer: bytes) -> tuple[int, bytes]:
    (error_code, message_size) = struct.unpack_from(">hh", answer, 8)
    at = 12 + max(0, message_size)
    (size,) = struct.unpack_from(">i", answer, at)
    return error_code, answer[at + 4 : at + 4 + max(0, size)]


def _request(api_key: int, version: int, body: bytes) -> bytes:
    header = struct.pack(">hhih", api_key, version, _CORRELATION_ID, len(_CLIENT_ID)) + _CLIENT_ID
    return struct.pack(">i", len(header) + len(body)) + header + body


@contextmanager
def _connected(server: str, context: ssl.SSLContext | None, timeout_s: float) -> Iterator[Any]:
    host, _, port = server.rpartition(":")
    host = host.strip("[]")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as raw:
        yield context.wrap_socket(raw, server_hostname=host) if context else raw


def _ask(sock: Any, request: bytes) -> bytes:
    """The answer's bytes, size prefix included: a whole response, or whatever came
    before the listener closed (ValueError where nothing did, or not this request's)."""
    sock.sendall(request)
    answer = b""
    while len(answer) < _MAX_RESPONSE:
        chunk = sock.recv(4096)
        if not chunk:
            break
        answer += chunk
        if len(answer) >= 4 and len(answer) >= 4 + struct.unpack_from(">i", answer)[0]:
            break
    if not answer:
        raise ValueError("the listener closed the connection without an answer")
    return answer
