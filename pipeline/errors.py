"""Typed errors under one root.

Expected operational failures (broker down, missing topic, missing model, disk
full, bad configuration) are `PipelineError`s: the CLI prints their message as
one actionable line and exits non-zero. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


class PipelineError(Exception):
    """Root of every expected, user-facing failure."""

    exit_code = 1


class ConfigError(PipelineError):
    """The configuration is invalid (flag, environment variable or file)."""

    exit_code = 2


class BrokerUnavailable(PipelineError):
    """No Kafka broker answered at the bootstrap servers."""

    exit_code = 3


class TopicMissing(PipelineError):
    """A topic the command needs does not exist."""

    exit_code = 4


class ModelError(PipelineError):
    """The embedding model cannot be found or loaded."""

    exit_code = 5


class OutputError(PipelineError):
    """The output directory cannot be written (permissions, disk full, ...)."""

    exit_code = 6


class IndexStateError(PipelineError):
    """The FAISS index is missing, corrupt or does not match the Parquet files."""

    exit_code = 7


class RecordError(PipelineError):
    """A Kafka record is not a valid input record; it goes to the dead-letter topic."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
