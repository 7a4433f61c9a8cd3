"""The `pipeline` group: global options, logging, the configuration file."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from pipeline.cli.options import PipelineGroup, env_option
from pipeline.core.config import (
    DEFAULT_BOOTSTRAP,
    SASL_MECHANISMS,
    SECURITY_PROTOCOLS,
    KafkaSettings,
    flatten_run_table,
    load_toml,
)
from pipeline.core.errors import ConfigError


@click.group(cls=PipelineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    envvar="PIPELINE_CONFIG",
    help="TOML file with default option values (flags and env vars win).",
)
@env_option(
    "--bootstrap-servers",
    default=DEFAULT_BOOTSTRAP,
    show_default=True,
    help="Kafka bootstrap servers, HOST:PORT[,HOST:PORT].",
)
@env_option(
    "--security-protocol",
    type=click.Choice(SECURITY_PROTOCOLS),
    default="PLAINTEXT",
    show_default=True,
    help="How clients talk to the brokers (kafka-python's security_protocol).",
)
@env_option(
    "--sasl-mechanism",
    type=click.Choice(SASL_MECHANISMS),
    default=None,
    help="SASL mechanism; required with SASL_PLAINTEXT and SASL_SSL [default: none].",
)
@env_option("--sasl-username", default=None, help="SASL user name.")
@env_option(
    "--sasl-password",
    default=None,
    help="SASL password; prefer the environment variable (kept out of ps and shell history).",
)
@env_option(
    "--ssl-cafile",
    default=None,
    help="CA certificates (PEM file) to verify the brokers with; the file must exist.",
)
@env_option("--ssl-certfile", default=None, help="Client certificate (PEM file), for mutual TLS.")
@env_option("--ssl-keyfile", default=None, help="Private key (PEM file) of --ssl-certfile.")
@env_option(
    "--ssl-password",
    default=None,
    help="Password of an encrypted --ssl-keyfile; prefer the environment variable.",
)
@env_option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
    help="Log lines on stderr from this level up (libraries': from WARNING, INFO with DEBUG).",
)
@click.pass_context
def main(ctx: click.Context, config_file: str | None, log_level: str, **kafka: Any) -> None:
    """Kafka -> micro-batches -> embeddings -> Parquet + FAISS, each record exactly once."""
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Library chatter stays at WARNING, except kafka at INFO when debugging the worker.
    library_level = logging.INFO if log_level.upper() == "DEBUG" else logging.WARNING
    for noisy in (
        "kafka",
        "transformers",
        "urllib3",
        "filelock",
        "faiss",
        "httpx",
        "botocore",
        "boto3",
    ):
        logging.getLogger(noisy).setLevel(max(library_level, logging.getLogger().level))
    # kafka-python times its IO loop's tasks; compressing a large producer batch
    # trips that warning many times a second, with nothing for a user to do.
    logging.getLogger("kafka.net.selector").setLevel(logging.ERROR)
    if log_level.upper() != "DEBUG":
        # Connection attempts and losses, one line each and many a second while a
        # broker is down or restarting: the pipeline says what it means in one line
        # of its own (retrying, or the error it exits with).
        for chatter in ("kafka.net", "kafka.cluster"):
            logging.getLogger(chatter).setLevel(logging.CRITICAL)
    if config_file:
        file_values = load_toml(config_file)
        ctx.default_map = {k: v for k, v in file_values.items() if isinstance(v, dict)}
        if "run" in ctx.default_map:
            ctx.default_map["run"] = flatten_run_table(ctx.default_map["run"], config_file)
        _check_tables(ctx.command, ctx.default_map, config_file)
        _apply_file_globals(
            ctx, kafka, {k: v for k, v in file_values.items() if not isinstance(v, dict)}
        )
    ctx.obj = _kafka_settings(kafka)


def _check_tables(command: click.Command, tables: dict[str, Any], path: str) -> None:
    """Rejects unknown commands and options in the file: a typo must not pass silently."""
    assert isinstance(command, click.Group)
    for name, table in tables.items():
        sub = command.commands.get(name)
        if sub is None:
            raise ConfigError(f"{path}: [{name}] is not a command")
        if isinstance(sub, click.Group):
            _check_tables(sub, table, path)
            continue
        known = {p.name for p in sub.params}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown option(s) {', '.join(unknown)} in [{name}]")


def _apply_file_globals(ctx: click.Context, kafka: dict[str, Any], values: dict[str, Any]) -> None:
    # Global options are parsed before the file is read, so file values fill only
    # what neither a flag nor an environment variable set.
    for name, value in values.items():
        if name not in kafka:
            raise ConfigError(f"unknown global option {name!r} in the configuration file")
        source = ctx.get_parameter_source(name)
        if source in (click.core.ParameterSource.DEFAULT, None):
            kafka[name] = value


def _kafka_settings(values: dict[str, Any]) -> KafkaSettings:
    return KafkaSettings(
        bootstrap_servers=values["bootstrap_servers"],
        security_protocol=values["security_protocol"],
        sasl_mechanism=values["sasl_mechanism"],
        sasl_plain_username=values["sasl_username"],
        sasl_plain_password=values["sasl_password"],
        ssl_cafile=values["ssl_cafile"],
        ssl_certfile=values["ssl_certfile"],
        ssl_keyfile=values["ssl_keyfile"],
        ssl_password=values["ssl_password"],
    )
