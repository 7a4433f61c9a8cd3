"""`pipeline topics create` and `pipeline produce`."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.cli.main import main
from pipeline.cli.options import env_option
from pipeline.core.config import (
    KafkaSettings,
)

# -- topics ---------------------------------------------------------------------------


@main.group()
def topics() -> None:
    """Manage topics."""


@topics.command("create")
@click.argument("topic")
@click.option(
    "--partitions",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Partition count: how many workers of one group can share the topic.",
)
@click.option(
    "--replication-factor",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Copies of each partition, at most the number of brokers.",
)
@click.pass_obj
def topics_create(
    kafka: KafkaSettings, topic: str, partitions: int, replication_factor: int
) -> None:
    """Create TOPIC (no error if it exists with the same partition count)."""
    from pipeline.kafka import cluster

    with cluster.admin_client(kafka) as admin:
        created = cluster.create_topic(admin, kafka, topic, partitions, replication_factor)
    click.echo(f"{'created' if created else 'exists'}: {topic} ({partitions} partitions)")


# -- produce --------------------------------------------------------------------------


@main.command()
@click.argument("topic")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@env_option(
    "--text-field",
    default="text",
    show_default=True,
    help="Field (JSONL key, CSV or Parquet column) holding the text; lines without a "
    "non-empty one are bad. Plain text: each line's text is put in this field.",
)
@env_option(
    "--id-field",
    default="id",
    show_default=True,
    help="Field holding the record id; kept in the value as is (named as for `run`).",
)
@env_option(
    "--key-field",
    default=None,
    help="Field whose value becomes the record key [default: no key, records spread "
    "round-robin over the partitions].",
)
@env_option(
    "--format",
    "fmt",
    type=click.Choice(["auto", "jsonl", "csv", "parquet", "text"]),
    default="auto",
    show_default=True,
    help="Format of FILES; auto: from each file's extension (.jsonl/.ndjson/.json, .csv, "
    ".parquet/.pq, .txt/.text).",
)
@env_option(
    "--compression",
    type=click.Choice(["none", "gzip", "snappy", "lz4", "zstd"]),
    default="gzip",
    show_default=True,
    help="Compression of the produced record batches.",
)
@env_option(
    "--skip-bad/--stop-on-bad",
    default=True,
    show_default=True,
    help="Skip a bad input line (reported with its line number) or stop at it.",
)
@env_option(
    "--progress/--no-progress",
    default=True,
    show_default=True,
    help="A progress line on stderr: a live one on a terminal, else a log line every 10 s.",
)
@click.pass_obj
def produce(
    kafka: KafkaSettings,
    topic: str,
    files: tuple[Path, ...],
    text_field: str,
    id_field: str,
    key_field: str | None,
    fmt: str,
    compression: str,
    skip_bad: bool,
    progress: bool,
) -> None:
    """Publish records from FILES (JSONL, CSV, Parquet or plain text) to TOPIC."""
    from pipeline.kafka.producer import produce as run_produce

    del id_field  # kept in the value as is; named for symmetry with `run`
    result = run_produce(
        kafka,
        topic,
        list(files),
        fmt=fmt,
        text_field=text_field,
        key_field=key_field,
        compression=compression,
        skip_bad=skip_bad,
        progress=progress,
    )
    rate = result.sent / result.seconds if result.seconds else 0.0
    click.echo(
        f"published {result.sent} records to {topic} ({result.skipped} bad lines skipped, "
        f"{rate:,.0f} records/s)"
    )
