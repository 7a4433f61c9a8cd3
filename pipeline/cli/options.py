"""What every command's options share: environment variables, the output type, one
line and a sysexits code for every expected failure."""

from __future__ import annotations

import contextlib
import errno
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from pipeline.core.errors import ConfigError, PipelineError

MODEL_HELP = (
    "'default' (the packaged all-MiniLM-L6-v2), 'multilingual-e5-small' (the multilingual "
    "extra), a local sentence-transformers or Hugging Face folder, or a hub id."
)

# Every command that takes --output says the same: where it is, and what it may be.
OUTPUT_METAVAR = "DIR|s3://BUCKET/PREFIX"
OUTPUT_HELP = (
    "The output: a local directory, or s3://bucket/prefix on an S3-compatible store "
    "(endpoint from PIPELINE_S3_ENDPOINT or AWS_ENDPOINT_URL, credentials from the "
    "standard AWS chain)."
)

F = Callable[..., Any]

# A bug (any exception but a PipelineError) exits EX_SOFTWARE, with its traceback.
BUG_EXIT_CODE = 70


class OutputPath(click.Path):
    """A local output directory, or `s3://bucket/prefix` on an S3-compatible store
    (sinks.objectstore: endpoint and credentials from the environment). Any other
    URL is refused in one line rather than turned into a local folder named `x:`."""

    def __init__(self) -> None:
        super().__init__(file_okay=False, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str) or "://" not in value:
            return super().convert(value, param, ctx)
        from sinks.objectstore import ObjectStore, is_object_store_url

        if not is_object_store_url(value):
            self.fail(f"{value}: give a local directory or s3://bucket/prefix", param, ctx)
        try:
            return ObjectStore.from_url(value)
        except PipelineError as exc:
            self.fail(str(exc), param, ctx)


OUTPUT = OutputPath()


def output_option(help: str = OUTPUT_HELP, **kwargs: Any) -> Callable[[F], F]:
    """`--output` (env PIPELINE_OUTPUT): a directory or s3://bucket/prefix, required
    unless told otherwise. A `help` of its own should say both forms too."""
    kwargs.setdefault("required", True)
    return env_option("--output", type=OUTPUT, metavar=OUTPUT_METAVAR, help=help, **kwargs)


def env_option(*decls: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option that also reads PIPELINE_<NAME> from the environment."""
    name = next(d for d in decls if d.startswith("--")).lstrip("-").replace("-", "_").upper()
    kwargs.setdefault("envvar", f"PIPELINE_{name}")
    kwargs.setdefault("show_envvar", True)
    return click.option(*decls, **kwargs)


class PipelineGroup(click.Group):
    """Turns expected failures into one line on stderr and an exit code outside 0-4,
    and a bug into its traceback, a line asking for a report, and exit 70.

    0-4 are findings (`status` verdicts, `audit` results), so nothing operational
    may use them: click's usage errors (exit 2 by default) exit 64 (EX_USAGE),
    like a ConfigError, and PipelineErrors exit with their own sysexits code.
    """

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        # The global options are parsed here, before invoke().
        with _usage_exit_code():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with _usage_exit_code():
                return super().invoke(ctx)
        except PipelineError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own: usage errors, ctx.exit(code), aborts
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
                raise  # click's main quiets a closed pipe (`pipeline status | head`)
            report_bug()
            ctx.exit(BUG_EXIT_CODE)


def report_bug() -> None:
    """The exception being handled is a bug, not an operational failure: its traceback,
    then one line saying so, on stderr."""
    traceback.print_exc()
    click.echo(
        "error: this is a bug in the pipeline, not a problem with its set-up; "
        "please report it with the traceback above",
        err=True,
    )


@contextlib.contextmanager
def _usage_exit_code() -> Iterator[None]:
    try:
        yield
    except click.UsageError as exc:  # BadParameter, MissingParameter, NoSuchOption, ...
        exc.exit_code = ConfigError.exit_code
        raise
