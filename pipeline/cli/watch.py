"""`pipeline status` and `pipeline audit`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from pipeline.cli.main import main
from pipeline.cli.options import OUTPUT_HELP, env_option, output_option
from pipeline.core.config import (
    KafkaSettings,
)
from pipeline.core.errors import ConfigError

# -- status ---------------------------------------------------------------------------


@main.command()
@env_option("--group", required=True, help="Consumer group id.")
@env_option(
    "--topic",
    "topic",
    multiple=True,
    help="Limit to these topics (repeatable) [default: the topics the group has commits for].",
)
@output_option(
    required=False,
    default=None,
    help=f"{OUTPUT_HELP} Also check that its segments account for every committed offset "
    "(verdict MISMATCH, exit 4, when not) and compare index entries with rows.",
)
@env_option("--dlq-topic", default=None, help="Dead-letter topic [default: <first topic>.dlq].")
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for machines.")
@click.option(
    "--watch",
    type=click.FloatRange(min=0.5),
    default=None,
    metavar="SECONDS",
    help="Refresh every SECONDS until interrupted (with --serve: read the broker every "
    "SECONDS, default 15).",
)
@click.option(
    "--serve",
    "serve_address",
    default=None,
    metavar="[HOST]:PORT",
    help="Serve the report as Prometheus metrics (pipeline_status_*) on HOST:PORT "
    "(default host: all interfaces) until SIGTERM, instead of printing it; a failed read "
    "is pipeline_status_up 0, not an exit.",
)
@click.pass_obj
def status(
    kafka: KafkaSettings,
    group: str,
    topic: tuple[str, ...],
    output: Path | None,
    dlq_topic: str | None,
    as_json: bool,
    watch: float | None,
    serve_address: str | None,
) -> None:
    """Lag report of a consumer group; the exit code is the group's verdict.

    0 OK, 1 LAGGING, 2 STALLED, 3 STOPPED, 4 MISMATCH (with --output);
    operational errors exit 64 and above (69: no broker answered).
    """
    from pipeline import status as lag

    topics_list = list(topic) or None
    if serve_address is not None:
        _serve(kafka, group, topics_list, output, dlq_topic, as_json, watch, serve_address)
        return
    if watch is not None:
        last = lag.watch(
            kafka, group, watch, topics_list, output, as_json=as_json, dlq_topic=dlq_topic
        )
        sys.exit(lag.exit_code_for(last["verdict"]) if last else 0)
    report = lag.collect_status(kafka, group, topics_list, output, dlq_topic=dlq_topic)
    click.echo(json.dumps(report, indent=2) if as_json else lag.render_table(report))
    sys.exit(lag.exit_code_for(report.get("verdict", "OK")))


def _serve(
    kafka: KafkaSettings,
    group: str,
    topics: list[str] | None,
    output: Path | None,
    dlq_topic: str | None,
    as_json: bool,
    watch: float | None,
    address: str,
) -> None:
    from pipeline.status.exporter import DEFAULT_INTERVAL_S, StatusExporter, serve

    if as_json:
        raise ConfigError("--serve answers scrapes; it prints nothing (drop --json)")
    exporter = StatusExporter(kafka, group, topics, output, dlq_topic=dlq_topic)
    serve(exporter, address, watch or DEFAULT_INTERVAL_S)


# -- audit ----------------------------------------------------------------------------


@main.command()
@output_option(help=f"{OUTPUT_HELP} Its Parquet rows are checked against the group's offsets.")
@env_option("--group", required=True, help="Consumer group id.")
@env_option(
    "--topic",
    "topic",
    multiple=True,
    help="Topic to audit (repeatable) [default: the topics the group has commits for].",
)
@env_option("--dlq-topic", default=None, help="Dead-letter topic [default: <first topic>.dlq].")
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for machines.")
@click.pass_obj
def audit(
    kafka: KafkaSettings,
    output: Path,
    group: str,
    topic: tuple[str, ...],
    dlq_topic: str | None,
    as_json: bool,
) -> None:
    """Check that every committed offset is in exactly one row or in the dead-letter topic.

    Offsets that are neither are read from Kafka: a real record there is
    missing. Exit 0 when nothing is missing or doubled, 1 otherwise.
    """
    from pipeline.audit import render_audit, run_audit

    report = run_audit(kafka, output, group, list(topic) or None, dlq_topic=dlq_topic)
    click.echo(json.dumps(report, indent=2) if as_json else render_audit(report))
    sys.exit(0 if report["ok"] else 1)
