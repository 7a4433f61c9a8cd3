"""The `pipeline` command, a module per group of commands.

Every option can come from a flag, a `PIPELINE_<OPTION>` environment variable or
a TOML file (`--config FILE` or `PIPELINE_CONFIG`), in that order of precedence:
top-level keys of the file set global options, a `[run]` (`[status]`, ...)
table sets that command's options, and `[run.<group>]` tables the worker's
options by group (pipeline.core.config.OPTION_FIELDS).
"""

from __future__ import annotations

from pipeline.cli import admin, data, outputs, run, watch  # noqa: F401 - they register commands
from pipeline.cli.main import main

__all__ = ["main"]
