"""`pipeline run`: the worker's flags, made into one WorkerConfig."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from pipeline.cli.main import main
from pipeline.cli.options import MODEL_HELP, F, env_option, output_option
from pipeline.core.chunks import OVERFLOWS
from pipeline.core.config import (
    DEVICES,
    PRECISIONS,
    SHAPES,
    TOKENIZER_PROCESS,
    KafkaSettings,
    WorkerConfig,
)
from pipeline.core.documents import DOCUMENT_KEYS, WRITE_MODES
from pipeline.core.errors import ConfigError

# -- run ------------------------------------------------------------------------------


def _run_option(flag: str, **kwargs: Any) -> Callable[[F], F]:
    """An option whose default is WorkerConfig's: --help and the configuration agree."""
    default = WorkerConfig.default_of(flag.lstrip("-").replace("-", "_"))
    return env_option(flag, default=default, show_default=True, **kwargs)


@main.command()
@env_option("--topic", "topic", multiple=True, required=True, help="Input topic (repeatable).")
@env_option("--group", required=True, help="Consumer group id.")
@output_option(
    help="Where the Parquet files and the FAISS index go: a local directory, or "
    "s3://bucket/prefix on an S3-compatible store (endpoint from PIPELINE_S3_ENDPOINT, "
    "credentials from the standard AWS chain).",
)
@_run_option(
    "--batch-size",
    type=int,
    help="Records per micro-batch, at most (batches fill only under a backlog; a caught-up "
    "worker closes them at once).",
)
@_run_option(
    "--poll-timeout-ms",
    type=int,
    help="Milliseconds a micro-batch may wait to fill after its first record.",
)
@_run_option(
    "--max-batch-tokens",
    type=int,
    help="Tokens (unpadded, after truncation to the model's length) per micro-batch, at most.",
)
@_run_option(
    "--max-batch-bytes",
    type=int,
    help="Bytes of record values per micro-batch, at most (a larger record travels alone); "
    "with --max-in-flight, what bounds the records a worker holds.",
)
@env_option(
    "--sub-batch-tokens",
    type=int,
    default=None,
    help="Padded tokens per forward pass [default: on the CPU, 12 MiB of the model's widest "
    "activation (2048 for all-MiniLM-L6-v2); 131072 on CUDA].",
)
@_run_option(
    "--max-in-flight",
    type=int,
    help="Micro-batches between poll and commit, at most; past it the worker pauses its "
    "partitions.",
)
@_run_option(
    "--precision",
    type=click.Choice(PRECISIONS),
    help="Model precision; auto: the fastest that passes the quality gate against fp32 "
    "(measured once per model and device, then remembered; see `pipeline model check`).",
)
@_run_option(
    "--device",
    type=click.Choice(DEVICES),
    help="Where the model runs; auto: cuda when a GPU is available, else cpu.",
)
@_run_option("--model", help=MODEL_HELP)
@env_option(
    "--document-prompt",
    default=None,
    help="Prepended to each record's text [default: the model's own, e.g. e5's 'passage: '; "
    "'' for none].",
)
@env_option(
    "--query-prompt",
    default=None,
    help="Recorded for `pipeline search` [default: the model's own, e.g. e5's 'query: '].",
)
@env_option(
    "--dimensions",
    type=int,
    default=None,
    help="Matryoshka: store the first N values of each vector, as sentence-transformers' "
    "truncate_dim does (not normalised again) [default: the model's own, or all].",
)
@env_option("--dlq-topic", default=None, help="Dead-letter topic [default: <first topic>.dlq].")
@_run_option("--text-field", help="JSON field of the input records holding the text.")
@_run_option("--id-field", help="JSON field of the input records holding the optional id.")
@_run_option(
    "--write-mode",
    type=click.Choice(WRITE_MODES),
    help="append: every record is a row. upsert: records are versions of documents by key; "
    "a tombstone deletes one; OUTPUT/current holds the live documents (docs/documents.md).",
)
@_run_option(
    "--document-key",
    type=click.Choice(DOCUMENT_KEYS),
    help="Upsert mode: a record's document is its --id-field value, or its Kafka key where it "
    "has none (id); or always its Kafka key (kafka-key).",
)
@_run_option(
    "--max-key-bytes",
    type=int,
    help="Upsert mode: document keys over this many UTF-8 bytes are bad records.",
)
@env_option(
    "--chunk-tokens",
    type=int,
    default=None,
    help="Cut texts longer than N model tokens into chunks of at most N, each a row with its "
    "own vector (docs/chunking.md) [default: off; texts past the model's length are cut "
    "and flagged truncated].",
)
@_run_option(
    "--chunk-overlap",
    type=int,
    help="With --chunk-tokens: tokens each chunk shares with the one before.",
)
@_run_option(
    "--max-chunks",
    type=int,
    help="With --chunk-tokens: chunks of one record, at most (past it: --chunk-overflow).",
)
@_run_option(
    "--chunk-overflow",
    type=click.Choice(OVERFLOWS),
    help="A record past --max-chunks: to the dead-letter topic (TooManyChunks), or keep its "
    "first chunks, flagged truncated.",
)
@_run_option(
    "--max-text-bytes",
    type=int,
    help="Texts over this many UTF-8 bytes are bad records (to the dead-letter topic).",
)
@env_option(
    "--until-end",
    is_flag=True,
    help="Bulk mode: take the topics' end offsets at start; exit 0 once the group's "
    "committed offsets reach them.",
)
@env_option(
    "--from-committed",
    is_flag=True,
    help="Start partitions this output holds nothing of at the group's committed offsets "
    "(a fresh --output for an existing --group).",
)
@env_option(
    "--backfill-topic",
    "backfill_topic",
    multiple=True,
    help="Lower-priority input topic (repeatable), same group: read only while the --topic "
    "ones have no lag.",
)
@_run_option(
    "--backfill-batch-ms",
    type=int,
    help="With --backfill-topic: backfill batches close at about this many milliseconds of "
    "embedding.",
)
@_run_option(
    "--max-poll-interval-ms",
    type=int,
    help="Kafka's max.poll.interval.ms: the longest gap between polls before the group "
    "drops the worker.",
)
@_run_option(
    "--session-timeout-ms",
    type=int,
    help="Kafka's session.timeout.ms: how long without heartbeats before the group drops a "
    "worker (a killed one stays a member that long).",
)
@_run_option(
    "--index-sync-interval-s",
    type=float,
    help="Seconds between FAISS index catch-ups during a run (it catches up fully at exit).",
)
@_run_option(
    "--compact-interval-s",
    type=float,
    help="Seconds between merges of small Parquet segments (pipeline compact); 0: never.",
)
@_run_option(
    "--view-sync-interval-s",
    type=float,
    help="Upsert mode: seconds between applies of new segments to the current view.",
)
@env_option(
    "--compact-purge",
    is_flag=True,
    help="Upsert mode: each compaction also erases superseded and deleted documents from "
    "every file (pipeline compact --purge).",
)
@_run_option("--compact-target-mb", type=int, help="MiB that merged segments grow to.")
@_run_option(
    "--shutdown-timeout-s",
    type=float,
    help="Seconds SIGTERM or SIGINT waits for the batches in flight; past it, the uncommitted "
    "ones are dropped (read again by the next worker).",
)
@_run_option(
    "--broker-timeout-s",
    type=float,
    help="Seconds to keep retrying a cluster that does not answer before exiting.",
)
@env_option(
    "--metrics-port",
    type=int,
    default=None,
    help="Serve Prometheus metrics on this TCP port, all interfaces [default: none].",
)
@env_option(
    "--progress/--no-progress",
    default=True,
    show_default=True,
    help="With --until-end: a progress bar on a terminal, else a log line every 10 s.",
)
@_run_option(
    "--shapes",
    type=click.Choice(SHAPES),
    help="Forward-pass shapes: a bounded set, or each batch's own (to measure the difference).",
)
@_run_option(
    "--tokenizer-process",
    type=click.Choice(TOKENIZER_PROCESS),
    help="Parse and tokenize in a child process, a poll ahead of the poll loop "
    "[auto: with 2+ CPUs].",
)
@env_option(
    "--tokenizer-processes",
    type=int,
    default=None,
    help="How many such children, each taking a slice of every poll [default: 1 on the CPU; "
    "beside a GPU, one per tokenizer thread of the plan].",
)
@env_option(
    "--replicas",
    type=int,
    default=None,
    help="Model replicas running passes at once on the CPU [default: one per usable core, "
    "less one above two, at most 4].",
)
@env_option(
    "--torch-threads",
    type=int,
    default=None,
    help="CPU threads per replica [default: the usable cores the replicas leave, shared].",
)
@_run_option(
    "--cache",
    help="Embedding cache by content: off, lru (in-process), or redis://HOST:PORT/DB "
    "(shared by workers and runs; the LRU stays in front).",
)
@_run_option("--cache-size", help="In-process cache bound: entries (50000) or bytes (32MiB, 1GB).")
@env_option(
    "--cache-ttl-s",
    type=float,
    default=None,
    help="Expiry of vectors written to Redis [default: none; the server's eviction].",
)
@_run_option(
    "--cache-timeout-ms", type=int, help="Redis connect and read timeout in ms (no retries)."
)
@click.pass_obj
def run(
    kafka: KafkaSettings, topic: tuple[str, ...], backfill_topic: tuple[str, ...], **options: Any
) -> None:
    """Consume, embed and write records until stopped (or to the end with --until-end)."""
    both = sorted(set(topic) & set(backfill_topic))
    if both:
        raise ConfigError(f"{', '.join(both)}: a topic is either --topic or --backfill-topic")
    config = WorkerConfig.of(
        tuple(topic) + tuple(backfill_topic),
        options.pop("group"),
        options.pop("output"),
        kafka,
        metrics_port=options.pop("metrics_port"),
        progress=options.pop("progress"),
        backfill_topics=tuple(backfill_topic),
        **options,
    )
    summary = run_worker(config)
    click.echo(f"done: {summary}", err=True)


# The worker's process (consumers.runtime); a name here so that tests take the config.
def run_worker(config: WorkerConfig) -> Any:
    from consumers.runtime import run

    return run(config)
