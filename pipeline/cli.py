"""The `pipeline` command.

Every option can come from a flag, a `PIPELINE_<OPTION>` environment variable or
a TOML file (`--config FILE` or `PIPELINE_CONFIG`), in that order of precedence:
top-level keys of the file set global options, a `[run]` (`[status]`, ...)
table sets that command's options.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from pipeline.core.config import (
    DEFAULT_BOOTSTRAP,
    DEVICES,
    PRECISIONS,
    SASL_MECHANISMS,
    SECURITY_PROTOCOLS,
    SHAPES,
    TOKENIZER_PROCESS,
    KafkaSettings,
    WorkerConfig,
    load_toml,
)
from pipeline.core.errors import ConfigError, PipelineError
from pipeline.core.host import (
    CpuPlan,
    plan_cpu,
    start_on_fresh_thread,
    usable_cpus,
    use_one_malloc_arena,
)

if TYPE_CHECKING:
    from pipeline.model.embedder import Embedder
    from pipeline.model.spec import ModelSpec

log = logging.getLogger("pipeline")

MODEL_HELP = (
    "'default' (the packaged all-MiniLM-L6-v2), 'multilingual-e5-small' (the multilingual "
    "extra), a local sentence-transformers or Hugging Face folder, or a hub id."
)

F = Callable[..., Any]


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


def env_option(*decls: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option that also reads PIPELINE_<NAME> from the environment."""
    name = next(d for d in decls if d.startswith("--")).lstrip("-").replace("-", "_").upper()
    kwargs.setdefault("envvar", f"PIPELINE_{name}")
    kwargs.setdefault("show_envvar", True)
    return click.option(*decls, **kwargs)


class PipelineGroup(click.Group):
    """Turns expected failures into one line on stderr and an exit code outside 0-4.

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


@contextlib.contextmanager
def _usage_exit_code() -> Iterator[None]:
    try:
        yield
    except click.UsageError as exc:  # BadParameter, MissingParameter, NoSuchOption, ...
        exc.exit_code = ConfigError.exit_code
        raise


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
)
@env_option("--sasl-mechanism", type=click.Choice(SASL_MECHANISMS), default=None)
@env_option("--sasl-username", default=None)
@env_option("--sasl-password", default=None, help="Prefer the environment variable.")
@env_option("--ssl-cafile", default=None)
@env_option("--ssl-certfile", default=None)
@env_option("--ssl-keyfile", default=None)
@env_option("--ssl-password", default=None)
@env_option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
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


# -- topics ---------------------------------------------------------------------------


@main.group()
def topics() -> None:
    """Manage topics."""


@topics.command("create")
@click.argument("topic")
@click.option("--partitions", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--replication-factor", type=click.IntRange(min=1), default=1, show_default=True)
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
@env_option("--text-field", default="text", show_default=True)
@env_option("--id-field", default="id", show_default=True)
@env_option("--key-field", default=None, help="Field whose value becomes the record key.")
@env_option(
    "--format",
    "fmt",
    type=click.Choice(["auto", "jsonl", "csv", "parquet", "text"]),
    default="auto",
    show_default=True,
)
@env_option(
    "--compression",
    type=click.Choice(["none", "gzip", "snappy", "lz4", "zstd"]),
    default="gzip",
    show_default=True,
)
@env_option(
    "--skip-bad/--stop-on-bad",
    default=True,
    show_default=True,
    help="Skip a bad input line (reported with its line number) or stop at it.",
)
@env_option("--progress/--no-progress", default=True, show_default=True)
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


# -- run ------------------------------------------------------------------------------


def _run_option(flag: str, **kwargs: Any) -> Callable[[F], F]:
    """An option whose default is WorkerConfig's: --help and the configuration agree."""
    default = WorkerConfig.default_of(flag.lstrip("-").replace("-", "_"))
    return env_option(flag, default=default, show_default=True, **kwargs)


@main.command()
@env_option("--topic", "topic", multiple=True, required=True, help="Input topic (repeatable).")
@env_option("--group", required=True, help="Consumer group id.")
@env_option("--output", required=True, type=OUTPUT)
@_run_option("--batch-size", type=int)
@_run_option("--poll-timeout-ms", type=int)
@_run_option("--max-batch-tokens", type=int)
@_run_option("--max-batch-bytes", type=int, help="Bytes of record values per micro-batch.")
@env_option(
    "--sub-batch-tokens",
    type=int,
    default=None,
    help="Padded tokens per forward pass [default: on the CPU, 12 MiB of the model's widest "
    "activation (2048 for all-MiniLM-L6-v2); 131072 on CUDA].",
)
@_run_option("--max-in-flight", type=int)
@_run_option("--precision", type=click.Choice(PRECISIONS))
@_run_option("--device", type=click.Choice(DEVICES))
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
    help="Matryoshka: store the first N values of each vector, normalised again where the "
    "model normalises (sentence-transformers' truncate_dim) [default: the model's own, or all].",
)
@env_option("--dlq-topic", default=None, help="Dead-letter topic [default: <first topic>.dlq].")
@_run_option("--text-field")
@_run_option("--id-field")
@_run_option("--max-text-bytes", type=int)
@env_option("--until-end", is_flag=True, help="Bulk mode: exit 0 at the end offsets at start.")
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
    help="With --backfill-topic: backfill batches close at about this much embedding.",
)
@_run_option("--max-poll-interval-ms", type=int)
@_run_option("--session-timeout-ms", type=int)
@_run_option("--index-sync-interval-s", type=float)
@_run_option(
    "--compact-interval-s",
    type=float,
    help="Merge small Parquet segments this often (pipeline compact); 0: never.",
)
@_run_option("--compact-target-mb", type=int, help="Size merged segments grow to.")
@_run_option("--shutdown-timeout-s", type=float)
@_run_option(
    "--broker-timeout-s",
    type=float,
    help="How long to keep retrying a cluster that does not answer before exiting.",
)
@env_option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics here.")
@env_option("--progress/--no-progress", default=True, show_default=True)
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
@_run_option("--cache-size", help="In-process cache bound: entries (50000) or bytes (32MiB).")
@env_option(
    "--cache-ttl-s",
    type=float,
    default=None,
    help="Expiry of vectors written to Redis [default: none; the server's eviction].",
)
@_run_option("--cache-timeout-ms", type=int, help="Redis socket timeouts (no retries).")
@click.pass_obj
def run(
    kafka: KafkaSettings, topic: tuple[str, ...], backfill_topic: tuple[str, ...], **options: Any
) -> None:
    """Consume, embed and write records until stopped (or to the end with --until-end)."""
    both = sorted(set(topic) & set(backfill_topic))
    if both:
        raise ConfigError(f"{', '.join(both)}: a topic is either --topic or --backfill-topic")
    config = WorkerConfig(
        topics=tuple(topic) + tuple(backfill_topic),
        backfill_topics=tuple(backfill_topic),
        kafka=kafka,
        **options,
    )
    _run_worker(config)


def _run_worker(config: WorkerConfig) -> None:
    # Tokenizing overlaps the model's forward passes on other threads; a parallel
    # tokenizer would only contend with them for the same cores (measured: -8%).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Before any other thread starts: free memory goes back to the OS in full after
    # each batch, and a backlog's passes do not leave it behind (pipeline.core.host).
    # Not where CUDA may serve: there up to eight tokenizer threads allocate at
    # once, and one arena's lock would serialise them (not measured on a GPU host).
    if config.device == "cpu" or (config.device == "auto" and not _nvidia_present()):
        use_one_malloc_arena()
    from consumers.worker import run_worker
    from pipeline.core.metrics import WorkerMetrics

    log.info("configuration: %s", json.dumps(config.redacted(), sort_keys=True))
    _check_cluster(config)  # fail fast, before the seconds a model load takes
    # What the model is, from its files, and whether the output holds another one's
    # vectors: refused in seconds, before any weights load.
    spec = _model_spec(config)
    shutdown = threading.Event()
    _install_signal_handlers(shutdown)
    # The model (torch's import included) loads while the worker checks the
    # cluster and its outputs; the worker waits for it before the first write.
    model = start_on_fresh_thread(
        lambda: _load_model(config, spec, _plan_cpu(config)), "model-load"
    )
    metrics = WorkerMetrics()
    if config.metrics_port is not None:
        metrics.serve(config.metrics_port)
        log.info("metrics on http://0.0.0.0:%d/metrics", config.metrics_port)
    try:
        summary = run_worker(config, model, shutdown, metrics)
    finally:
        if model.done() and model.exception() is None:
            model.result().close()
    click.echo(f"done: {summary}", err=True)


def _nvidia_present() -> bool:
    """Whether an NVIDIA driver is loaded, without importing torch (seconds)."""
    return os.path.exists("/dev/nvidiactl")


def _model_spec(config: WorkerConfig) -> ModelSpec:
    from pipeline.model.spec import ModelSpec
    from sinks.identity import check_output_model

    spec = ModelSpec.read(
        config.model, config.document_prompt, config.query_prompt, config.dimensions
    )
    # int8 is the one precision of another identity; auto never picks it.
    kind = "int8" if config.precision == "int8" else "fp32"
    check_output_model(config.output, spec.info(kind, config.device))
    return spec


def _load_model(config: WorkerConfig, spec: ModelSpec, plan: CpuPlan) -> Embedder:
    from pipeline.model.embedder import Embedder
    from pipeline.model.precision import resolve_precision

    precision = config.precision
    if precision == "auto":
        from pipeline.core.corpus import sample_texts

        precision = resolve_precision(spec, config.device, "auto", lambda: sample_texts(256))
    return Embedder.load_planned(
        config.model,
        precision,
        plan,
        config.sub_batch_tokens,
        config.shapes == "exact",
        spec=spec,
    )


def _check_cluster(config: WorkerConfig) -> None:
    from pipeline.kafka import cluster

    with cluster.admin_client(config.kafka) as admin:
        cluster.partitions_of(admin, config.kafka, config.topics)


def _plan_cpu(config: WorkerConfig) -> CpuPlan:
    import torch

    from pipeline.model.embedder import pick_device

    cpus = usable_cpus()
    plan = plan_cpu(pick_device(config.device), cpus, config.replicas, config.torch_threads)
    torch.set_num_threads(plan.threads_per_replica)
    log.info("model threads: %s (%d usable CPUs)", plan, cpus)
    return plan


def _install_signal_handlers(shutdown: threading.Event) -> None:
    def handler(signum: int, _frame: Any) -> None:
        if shutdown.is_set():
            raise KeyboardInterrupt  # a second signal: stop now, outputs stay consistent
        log.info("%s received: finishing the batches in flight", signal.Signals(signum).name)
        shutdown.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


# -- status ---------------------------------------------------------------------------


@main.command()
@env_option("--group", required=True)
@env_option("--topic", "topic", multiple=True, help="Limit to these topics (repeatable).")
@env_option(
    "--output",
    type=OUTPUT,
    default=None,
    help="Also check that the output's segments account for every committed offset "
    "(verdict MISMATCH, exit 4, when not) and compare index entries with rows.",
)
@env_option("--dlq-topic", default=None, help="Dead-letter topic [default: <first topic>.dlq].")
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for machines.")
@click.option(
    "--watch",
    type=click.FloatRange(min=0.5),
    default=None,
    metavar="SECONDS",
    help="Refresh every SECONDS until interrupted.",
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
) -> None:
    """Lag report of a consumer group; the exit code is the group's verdict.

    0 OK, 1 LAGGING, 2 STALLED, 3 STOPPED, 4 MISMATCH (with --output);
    operational errors exit 64 and above (69: no broker answered).
    """
    from pipeline import status as lag

    topics_list = list(topic) or None
    if watch is not None:
        last = lag.watch(
            kafka, group, watch, topics_list, output, as_json=as_json, dlq_topic=dlq_topic
        )
        sys.exit(lag.exit_code_for(last["verdict"]) if last else 0)
    report = lag.collect_status(kafka, group, topics_list, output, dlq_topic=dlq_topic)
    click.echo(json.dumps(report, indent=2) if as_json else lag.render_table(report))
    sys.exit(lag.exit_code_for(report.get("verdict", "OK")))


# -- audit ----------------------------------------------------------------------------


@main.command()
@env_option("--output", required=True, type=OUTPUT)
@env_option("--group", required=True)
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


# -- search ---------------------------------------------------------------------------


@main.command()
@env_option("--output", required=True, type=OUTPUT)
@click.option("-k", "k", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@env_option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@env_option(
    "--query-prompt",
    default=None,
    help="Prepended to QUERY [default: the query prompt recorded in the output; '' for none].",
)
@click.argument("query")
def search(
    output: Path, k: int, as_json: bool, device: str, query_prompt: str | None, query: str
) -> None:
    """Embed QUERY with the output's model and print its nearest records."""
    from pipeline.search import search_output

    hits = search_output(output, query, k, device, query_prompt)
    if as_json:
        click.echo(json.dumps({"query": query, "hits": hits}, indent=2, ensure_ascii=False))
        return
    for rank, hit in enumerate(hits, 1):
        text = " ".join(hit["text"].split())
        text = text if len(text) <= 160 else text[:157] + "..."
        click.echo(
            f"{rank:>2}. {hit['score']:.4f}  {hit['topic']}[{hit['partition']}]@"
            f"{hit['offset']}  id={hit['id']}\n    {text}"
        )


# -- compact --------------------------------------------------------------------------


@main.command()
@env_option("--output", required=True, type=OUTPUT)
@click.option(
    "--target-mb",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Merged files grow up to this size; files of half of it or more stay as they are.",
)
@click.option("--dry-run", is_flag=True, help="Say what would be merged; change nothing.")
@click.option("--json", "as_json", is_flag=True)
def compact(output: Path, target_mb: int, dry_run: bool, as_json: bool) -> None:
    """Merge runs of small Parquet segments in OUTPUT into large ones.

    Safe while workers run: readers listing OUTPUT/vectors see the sources or
    the merged files, never both and never neither; ranges, restart points and
    the index do not change.
    """
    import json

    from sinks.compaction import compact as compact_output
    from sinks.compaction import settle

    report = compact_output(output, target_bytes=target_mb << 20, dry_run=dry_run)
    if not dry_run and isinstance(output, Path):
        settle(output)  # the old files go once readers listing them are done (seconds)
    if as_json:
        click.echo(json.dumps(dict(report.as_dict(), dry_run=dry_run), indent=1, sort_keys=True))
        return
    verb = "would merge" if dry_run else "merged"
    click.echo(
        f"{verb} {report.merged_files} segment(s) into {report.runs} "
        f"({report.rows} rows): {report.files_before} -> {report.files_after} files "
        f"in {output}/vectors, {report.seconds:.1f}s"
    )
    for line in report.skipped:
        click.echo(f"skipped {line}", err=True)


# -- index ----------------------------------------------------------------------------


@main.group()
def index() -> None:
    """Manage the FAISS index of an output directory."""


@index.command("rebuild")
@env_option("--output", required=True, type=OUTPUT)
@click.option(
    "--index-type",
    type=click.Choice(["flat", "ivf", "ivf-pq"]),
    default="flat",
    show_default=True,
    help="flat: exact search; ivf / ivf-pq: trained on a sample, faster on large "
    "corpora (ivf-pq also 32x smaller), recall@10 against exact search reported.",
)
def index_rebuild(output: Path, index_type: str) -> None:
    """Rebuild the index from the Parquet files in OUTPUT."""
    from pipeline.core.errors import IndexStateError
    from sinks.index.store import IndexStore

    store = IndexStore(output, index_type=index_type)
    count = store.rebuild()
    meta = store.meta
    recall = (
        "" if meta is None or meta.recall_at_10 is None else f", recall@10 {meta.recall_at_10:.3f}"
    )
    shards = 0 if meta is None else len(meta.shards)
    click.echo(
        f"index rebuilt: {count} vectors ({index_type}, {shards} file(s){recall}) "
        f"in {output}/index, {store.last_sync.seconds:.1f}s"
    )
    if store.damaged:
        for damaged in store.damaged:
            click.echo(f"warning: skipped {damaged.segment.path} ({damaged.reason})", err=True)
        raise IndexStateError(
            f"{len(store.damaged)} damaged segment(s) left out of the index, with the rest of "
            "their partitions; start a worker (pipeline run) on this output: it moves them "
            "to quarantine/, reads their records again from Kafka, and the index catches up"
        )


@index.command("check")
@env_option("--output", required=True, type=OUTPUT)
@click.option(
    "--recall",
    is_flag=True,
    help="Also measure recall@10 against exact search now (reads every vector once).",
)
@click.option("--json", "as_json", is_flag=True)
def index_check(output: Path, recall: bool, as_json: bool) -> None:
    """Check the index against the Parquet files: every covered row once, nothing else.

    Exit 0 when it holds, 65 when rows are missing, extra or doubled.
    """
    import json

    from pipeline.core.errors import IndexStateError
    from sinks.index.check import check_index

    report = check_index(output, recall=recall)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=1, sort_keys=True))
    else:
        noted = "" if report.recall_at_10 is None else f", recall@10 {report.recall_at_10:.3f}"
        if report.measured_recall_at_10 is not None:
            noted += f", recall@10 measured now {report.measured_recall_at_10:.3f}"
        click.echo(
            f"{report.index_type} index, generation {report.generation}: {report.vectors} "
            f"vectors in {report.shards} file(s), {report.bytes / 1e6:.1f} MB{noted}\n"
            f"missing {report.missing}, extra {report.extra}, doubled {report.doubled}; "
            f"{report.uncovered_rows} Parquet row(s) not synced yet"
        )
    if not report.ok:
        raise IndexStateError(
            f"the index of {output} does not match its Parquet files; run: "
            f"pipeline index rebuild --output {output}"
        )


# -- offsets --------------------------------------------------------------------------


@main.group()
def offsets() -> None:
    """Manage a consumer group's committed offsets."""


@offsets.command("reset")
@env_option("--group", required=True, help="Consumer group id.")
@env_option(
    "--topic",
    "topic",
    multiple=True,
    required=True,
    help="Topic to reset (repeatable); TOPIC:0,2 for some of its partitions.",
)
@click.option("--to-earliest", is_flag=True, help="The first offset still retained.")
@click.option(
    "--to-latest", is_flag=True, help="The end (last stable offset): skip what is there now."
)
@click.option(
    "--to-datetime",
    metavar="ISO",
    default=None,
    help="The first record at or after this ISO 8601 time (no timezone means UTC), "
    "e.g. 2024-05-01T12:00:00Z; the end where there is none.",
)
@click.option(
    "--to-offset",
    type=int,
    metavar="N",
    default=None,
    help="Offset N, clamped into [earliest, end].",
)
@click.option(
    "--shift-by",
    type=int,
    metavar="N",
    default=None,
    help="The committed offset plus N (negative: back), clamped into [earliest, end]; "
    "from earliest where nothing is committed.",
)
@click.option("--dry-run", is_flag=True, help="Show the new offsets, change nothing.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="A JSON list, one object per partition (the closing line goes to stderr).",
)
@click.pass_obj
def offsets_reset(
    kafka: KafkaSettings,
    group: str,
    topic: tuple[str, ...],
    to_earliest: bool,
    to_latest: bool,
    to_datetime: str | None,
    to_offset: int | None,
    shift_by: int | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Move GROUP's committed offsets on TOPIC, like kafka-consumer-groups.sh --reset-offsets.

    Give exactly one of --to-earliest, --to-latest, --to-datetime, --to-offset,
    --shift-by. New offsets are clamped into each partition's [earliest, end]
    range (the NOTE column says where). Refused while the group has members:
    stop its workers first. A group that does not exist yet gets its offsets.

    A worker starts each partition past what its --output already holds; the
    committed offsets decide only where it starts a partition that output holds
    nothing of. To re-embed, reset, then run with a fresh --output (adding
    --from-committed unless the reset was to the earliest offsets).

    Exit 0 when done (or shown, with --dry-run); 75 while the group has members,
    66 for a missing topic, 69 when no broker answers.
    """
    from pipeline.kafka import offsets as resets

    mode = resets.choose_mode(to_earliest, to_latest, to_datetime, to_offset, shift_by)
    specs = [resets.parse_topic_spec(spec) for spec in topic]
    result = resets.reset_offsets(kafka, group, specs, mode, dry_run=dry_run)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in result.partitions], indent=2))
        click.echo(result.summary(), err=True)
    else:
        click.echo(resets.render_table(result))
        click.echo(result.summary())


# -- model ----------------------------------------------------------------------------


@main.group()
def model() -> None:
    """Inspect the embedding model."""


@model.command("check")
@env_option("--model", default="default", show_default=True, help=MODEL_HELP)
@env_option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@env_option("--dimensions", type=int, default=None, help="Matryoshka truncation, as for run.")
@env_option("--document-prompt", default=None, help="As for run [default: the model's own].")
@click.option(
    "--precision",
    "precisions",
    multiple=True,
    type=click.Choice([p for p in PRECISIONS if p != "auto"]),
    help="Precision to check (repeatable) [default: all the device supports].",
)
@click.option("--samples", type=click.IntRange(min=20), default=512, show_default=True)
@click.option("--min-cosine", type=float, default=0.995, show_default=True)
@click.option("--min-recall", type=float, default=0.95, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def model_check(
    model: str,
    device: str,
    dimensions: int | None,
    document_prompt: str | None,
    precisions: tuple[str, ...],
    samples: int,
    min_cosine: float,
    min_recall: float,
    as_json: bool,
) -> None:
    """What the worker will run for a model, its vectors against sentence-transformers'
    (where installed), and each precision against fp32: cosine, recall@10, texts/s.
    Exit 1 where the vectors differ from sentence-transformers'."""
    from dataclasses import asdict

    from pipeline.core.corpus import sample_texts
    from pipeline.model import check
    from pipeline.model.embedder import Embedder
    from pipeline.model.precision import Gate, check_precisions, choose, remember
    from pipeline.model.spec import ModelSpec

    spec = ModelSpec.read(model, document_prompt, None, dimensions)
    plan = check.plan(spec)
    if not as_json:
        click.echo("\n".join(check.render_plan(plan)))
    texts = sample_texts(samples)
    parity = None
    if check.reference_available():
        embedder = Embedder.load(device="cpu", spec=spec)
        try:
            parity = check.against_reference(embedder, [*texts[:59], *check.EXTRA_TEXTS])
        finally:
            embedder.close()
    if not as_json:
        click.echo(_parity_line(parity))
    gate = Gate(min_cosine, min_recall)
    reports = check_precisions(spec, device, texts, list(precisions) or None, gate)
    remember(spec, reports[0].device, gate, reports)
    best = choose(reports)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "model": plan,
                    "sentence_transformers": None
                    if parity is None
                    else {**asdict(parity), "passed": parity.passed},
                    "gate": asdict(gate),
                    "choice": best.precision,
                    "reports": [asdict(r) for r in reports],
                },
                indent=2,
            )
        )
    else:
        _echo_precisions(reports, best, gate)
    if parity is not None and not parity.passed:
        sys.exit(1)


def _parity_line(parity: Any) -> str:
    from pipeline.model.check import PARITY_MIN_COSINE

    if parity is None:
        return "parity       not checked: sentence-transformers is not installed"
    verdict = "PASS" if parity.passed else "DIFFERENT"
    return (
        f"parity       {verdict}: cosine to {parity.reference} on {parity.texts} texts "
        f"(fp32, CPU): min {parity.cosine_min:.6f}, mean {parity.cosine_mean:.6f} "
        f"(pass: min >= {PARITY_MIN_COSINE})"
    )


def _echo_precisions(reports: list[Any], best: Any, gate: Any) -> None:
    click.echo(
        f"\n{'precision':<10}{'device':<8}{'cos mean':>10}{'cos min':>10}"
        f"{'recall@10':>11}{'texts/s':>10}  gate"
    )
    for r in reports:
        click.echo(
            f"{r.precision:<10}{r.device:<8}{r.cosine_mean:>10.4f}{r.cosine_min:>10.4f}"
            f"{r.recall_at_10:>11.3f}{r.texts_per_s:>10.0f}  "
            f"{'pass' if r.passed else 'FAIL'}"
        )
    click.echo(
        f"auto picks: {best.precision} (gate: cosine mean >= {gate.min_cosine_mean}, "
        f"recall@10 >= {gate.min_recall_at_10})"
    )


if __name__ == "__main__":  # pragma: no cover
    main()
