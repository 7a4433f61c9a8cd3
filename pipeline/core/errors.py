"""Typed errors under one root.

Expected operational failures (broker down, missing topic, missing model, disk
full, bad configuration) are `PipelineError`s: the CLI prints their message as
one actionable line and exits non-zero. Anything else is a bug and keeps its
traceback.

Exit codes follow BSD sysexits and stay out of 0-4, which `pipeline status`
uses for its verdicts and `pipeline audit` for its findings: a script can tell
"the group is stopped" (3) from "the broker is down" (69).
"""

from __future__ import annotations


class PipelineError(Exception):
    """Root of every expected, user-facing failure."""

    exit_code = 70  # EX_SOFTWARE


class ConfigError(PipelineError):
    """The configuration is invalid (flag, environment variable or file)."""

    exit_code = 64  # EX_USAGE, as for a bad command line


class IndexStateError(PipelineError):
    """The FAISS index is missing, corrupt or does not match the Parquet files."""

    exit_code = 65  # EX_DATAERR


class TopicMissing(PipelineError):
    """A topic the command needs does not exist."""

    exit_code = 66  # EX_NOINPUT


class BrokerUnavailable(PipelineError):
    """No Kafka broker answered, or the cluster kept failing past the retry deadline."""

    exit_code = 69  # EX_UNAVAILABLE


class ModelError(PipelineError):
    """The embedding model cannot be found or loaded."""

    exit_code = 72  # EX_OSFILE


class OutputError(PipelineError):
    """The output directory cannot be written (permissions, disk full, ...) or used."""

    exit_code = 73  # EX_CANTCREAT


class SecureConnectionFailed(PipelineError):
    """No secured conversation with the broker: its certificate is not trusted or not
    for the host name dialled, or the listener speaks another protocol than the one
    configured (TLS against a plaintext port, SASL against a port without it, ...)."""

    exit_code = 76  # EX_PROTOCOL


class AccessDenied(PipelineError):
    """The cluster refused this client: its SASL credentials or mechanism, the client
    certificate mutual TLS asks for, or an ACL."""

    exit_code = 77  # EX_NOPERM


class SetupError(PipelineError):
    """This machine's set-up cannot work, whatever the cluster: its TLS files (a CA,
    certificate or key file that is not PEM, a key that is not the certificate's, one
    --ssl-password does not decrypt), or a kafka-python other than the release the
    pipeline is pinned to. Nothing was asked of a broker."""

    exit_code = 78  # EX_CONFIG


class RecordError(PipelineError):
    """A Kafka record is not a valid input record; it goes to the dead-letter topic."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
