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


class RecordError(PipelineError):
    """A Kafka record is not a valid input record; it goes to the dead-letter topic."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
