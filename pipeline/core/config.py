"""The one frozen, validated configuration object of a run.

Flags, `PIPELINE_*` environment variables and a TOML file (`--config`) feed it,
in that order of precedence (the CLI does the layering with click); this module
validates the merged values once at start and never changes them afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core.chunks import MAX_CHUNKS_LIMIT, OVERFLOWS, Chunking
from pipeline.core.documents import DOCUMENT_KEYS, UPSERT, WRITE_MODES, DocumentKeys
from pipeline.core.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.core.layout import Output

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_MODEL = "default"
PRECISIONS = ("auto", "fp32", "bf16", "fp16", "int8")
DEVICES = ("auto", "cpu", "cuda")
SHAPES = ("bucketed", "exact")
TOKENIZER_PROCESS = ("auto", "on", "off")
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")
_SECRET_FIELDS = frozenset({"sasl_plain_password", "ssl_password"})
_URL_FIELDS = frozenset({"spec"})  # URLs whose password is redacted (the cache's)
# The embedding cache (pipeline.model.cache): off, in-process, or a Redis URL.
CACHE_OFF = "off"
CACHE_LRU = "lru"
REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class KafkaSettings:
    """How to reach the cluster; passed through to every kafka-python client."""

    bootstrap_servers: str = DEFAULT_BOOTSTRAP
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: str | None = field(default=None, repr=False)
    client_id: str = "embedding-pipeline"
    request_timeout_ms: int = 30_000

    def __post_init__(self) -> None:
        servers = [s.strip() for s in self.bootstrap_servers.split(",") if s.strip()]
        if not servers:
            raise ConfigError("bootstrap servers are empty: give HOST:PORT[,HOST:PORT]")
        for server in servers:
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(f"bootstrap server {server!r} is not HOST:PORT")
        _check_choice("security protocol", self.security_protocol, SECURITY_PROTOCOLS)
        if self.sasl_mechanism is not None:
            _check_choice("SASL mechanism", self.sasl_mechanism, SASL_MECHANISMS)
        if self.security_protocol.startswith("SASL") and self.sasl_mechanism is None:
            raise ConfigError(f"security protocol {self.security_protocol} needs --sasl-mechanism")
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{name.replace('_', ' ')} {path} does not exist")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ConfigError("--ssl-keyfile needs its certificate (--ssl-certfile)")

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments shared by KafkaConsumer, KafkaProducer and KafkaAdminClient."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers.split(","),
            "security_protocol": self.security_protocol,
            "client_id": self.client_id,
            "request_timeout_ms": self.request_timeout_ms,
        }
        optional = (
            "sasl_mechanism",
            "sasl_plain_username",
            "sasl_plain_password",
            "ssl_cafile",
            "ssl_certfile",
            "ssl_keyfile",
            "ssl_password",
        )
        for name in optional:
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs


@dataclass(frozen=True)
class InputSettings:
    """What is read, and how a record's value is taken."""

    # Among the topics, those read only while the others (nearline) have no lag
    # (consumers.tiers).
    backfill_topics: tuple[str, ...] = ()
    dlq_topic: str | None = None
    text_field: str = "text"
    id_field: str = "id"
    max_text_bytes: int = 65_536
    until_end: bool = False
    # Start partitions that this output holds nothing of at the group's committed
    # offsets (by default that is refused: it would silently leave out every record
    # before them).
    from_committed: bool = False
    # Documents by key (pipeline.core.documents): "append" stores every record; "upsert"
    # also keeps the current view (sinks.view): one row per live document.
    write_mode: str = "append"
    document_key: str = "id"
    max_key_bytes: int = 1024
    # Long texts cut into windows of this many tokens, `chunk_overlap` shared by
    # neighbours (pipeline.core.chunks); None: embedded whole, cut at the model's length.
    chunk_tokens: int | None = None
    chunk_overlap: int = 0
    max_chunks: int = 128
    chunk_overflow: str = "dead-letter"


@dataclass(frozen=True)
class BatchingSettings:
    """How micro-batches close, and how many may be between poll and commit."""

    # Large batches sort better (fewer, fuller forward passes); they only fill
    # under a backlog, as a batch closes as soon as the worker has caught up.
    batch_size: int = 4096
    poll_timeout_ms: int = 500
    max_batch_tokens: int = 262_144
    # Bytes of record values per micro-batch: with max_in_flight, what bounds the
    # records the worker holds, whatever their size.
    max_batch_bytes: int = 16 * 1024 * 1024
    max_in_flight: int = 2
    # Backfill batches close at about this many milliseconds of embedding, which
    # bounds the backfill work ahead of a nearline record (consumers.tiers).
    backfill_batch_ms: int = 1000


@dataclass(frozen=True)
class ModelSettings:
    """The model and how it runs on this host."""

    name: str = DEFAULT_MODEL
    precision: str = "auto"
    device: str = "auto"
    # Prepended to each record's text (pipeline.model.prompts); None: the model's own
    # (config_sentence_transformers.json), "" none.
    document_prompt: str | None = None
    query_prompt: str | None = None
    # Matryoshka: keep the first N values of each vector (not normalised again, as
    # sentence-transformers' truncate_dim); None: the model's own truncate_dim, or all.
    dimensions: int | None = None
    # Padded tokens (longest x count) per forward pass; bounds activation memory.
    # None: by device and model (pipeline.model.shapes.pass_defaults).
    sub_batch_tokens: int | None = None
    # Forward-pass shapes: "bucketed" (a bounded set, pipeline.model.shapes) or "exact".
    shapes: str = "bucketed"
    # Model replicas and threads per replica; None: from the usable CPUs (core.host).
    replicas: int | None = None
    torch_threads: int | None = None
    # Tokenizing in child processes, a poll ahead of the poll loop
    # (consumers.tokenize_process): "auto" where this process may use 2 CPUs or more;
    # how many (None: one on the CPU, the plan's tokenizer threads beside a GPU).
    tokenizer_process: str = "auto"
    tokenizer_processes: int | None = None


@dataclass(frozen=True)
class StorageSettings:
    """The output's index and compaction (the output itself: WorkerConfig.output)."""

    index_sync_interval_s: float = 30.0
    # Upsert mode: how often the current view applies the published segments; its
    # delay behind them is about this plus one apply (docs/documents.md).
    view_sync_interval_s: float = 5.0
    # Small segments are merged this often (sinks.compaction); 0 turns it off.
    compact_interval_s: float = 600.0
    compact_target_mb: int = 128
    # Upsert mode: each of those compactions also erases superseded and deleted
    # documents from every file (sinks.purge), as `pipeline compact --purge` does.
    compact_purge: bool = False


@dataclass(frozen=True)
class LivenessSettings:
    """How long the worker waits for the group, the cluster and itself."""

    max_poll_interval_ms: int = 300_000
    session_timeout_ms: int = 45_000
    # How long a revocation waits for in-flight batches; it blocks kafka-python's IO thread.
    revoke_timeout_s: float = 5.0
    # How long the worker keeps retrying a cluster that does not answer (commits,
    # dead letters, end checks) before it exits with one line; the consumer itself
    # reconnects on its own through broker restarts.
    broker_timeout_s: float = 300.0
    shutdown_timeout_s: float = 60.0


@dataclass(frozen=True)
class CacheSettings:
    """The embedding cache by content (pipeline.model.cache): "off", "lru"
    (in-process), or a Redis URL shared by workers and runs (the LRU stays in front).
    Size: entries ("50000") or bytes ("32MiB"); the TTL and timeouts are Redis's."""

    spec: str = "lru"
    size: str = "32MiB"
    ttl_s: float | None = None
    timeout_ms: int = 500


# Each `pipeline run` flag (its option name) -> (group, field); the TOML file's
# [run.<group>] tables hold the same option names.
GROUPS: dict[str, type] = {
    "input": InputSettings,
    "batching": BatchingSettings,
    "model": ModelSettings,
    "storage": StorageSettings,
    "liveness": LivenessSettings,
    "cache": CacheSettings,
}
_RENAMED = {
    "model": ("model", "name"),
    "cache": ("cache", "spec"),
    "cache_size": ("cache", "size"),
    "cache_ttl_s": ("cache", "ttl_s"),
    "cache_timeout_ms": ("cache", "timeout_ms"),
}
OPTION_FIELDS: dict[str, tuple[str, str]] = {
    **{
        name: (group, name)
        for group, settings in GROUPS.items()
        for name in settings.__dataclass_fields__
        if name not in ("name", "spec", "size", "ttl_s", "timeout_ms")
    },
    **_RENAMED,
}


@dataclass(frozen=True)
class WorkerConfig:
    """Everything `pipeline run` needs, validated once: what it reads and writes at the
    top, the rest in groups (the flags and the TOML file's [run.<group>] tables follow
    them: OPTION_FIELDS)."""

    topics: tuple[str, ...]
    group: str
    output: Output  # a directory, or an object store (pipeline.core.layout)
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    input: InputSettings = field(default_factory=InputSettings)
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    storage: StorageSettings = field(default_factory=StorageSettings)
    liveness: LivenessSettings = field(default_factory=LivenessSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    metrics_port: int | None = None
    progress: bool = True

    @classmethod
    def of(
        cls,
        topics: tuple[str, ...] | list[str],
        group: str,
        output: Output,
        kafka: KafkaSettings | None = None,
        metrics_port: int | None = None,
        progress: bool = True,
        **options: Any,
    ) -> WorkerConfig:
        """From flat options, as the flags name them (`batch_size=...`, `model=...`)."""
        grouped: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        for name, value in options.items():
            if name not in OPTION_FIELDS:
                raise ConfigError(f"unknown worker option {name!r}")
            group_name, field_name = OPTION_FIELDS[name]
            grouped[group_name][field_name] = value
        made = {name: GROUPS[name](**values) for name, values in grouped.items()}
        return cls(
            tuple(topics),
            group,
            output,
            kafka or KafkaSettings(),
            metrics_port=metrics_port,
            progress=progress,
            **made,
        )

    def __post_init__(self) -> None:
        if not self.topics:
            raise ConfigError("give at least one --topic")
        for topic in self.topics:
            _check_topic_name(topic)
        backfill = self.input.backfill_topics
        unknown = [t for t in backfill if t not in self.topics]
        if unknown:
            raise ConfigError(f"backfill topic(s) {', '.join(unknown)} are not among the topics")
        if backfill and set(self.topics) <= set(backfill):
            raise ConfigError("give at least one --topic besides the --backfill-topic ones")
        if not self.group.strip():
            raise ConfigError("--group must not be empty")
        b, m, live = self.batching, self.model, self.liveness
        for label, value in (
            ("backfill batch (ms)", b.backfill_batch_ms),
            ("batch size", b.batch_size),
            ("poll timeout (ms)", b.poll_timeout_ms),
            ("max batch tokens", b.max_batch_tokens),
            ("max batch bytes", b.max_batch_bytes),
            ("max in flight", b.max_in_flight),
            ("max text bytes", self.input.max_text_bytes),
            ("max poll interval (ms)", live.max_poll_interval_ms),
            ("broker timeout (s)", live.broker_timeout_s),
            ("compaction target (MB)", self.storage.compact_target_mb),
            ("cache timeout (ms)", self.cache.timeout_ms),
        ):
            _check_positive(label, value)
        if self.storage.compact_interval_s < 0:
            raise ConfigError("--compact-interval-s must be 0 (off) or more")
        for label, optional in (
            ("replicas", m.replicas),
            ("torch threads", m.torch_threads),
            ("sub-batch tokens", m.sub_batch_tokens),
            ("dimensions", m.dimensions),
            ("tokenizer processes", m.tokenizer_processes),
            ("cache TTL (s)", self.cache.ttl_s),
        ):
            if optional is not None:
                _check_positive(label, optional)
        _check_choice("write mode", self.input.write_mode, WRITE_MODES)
        _check_choice("document key", self.input.document_key, DOCUMENT_KEYS)
        if self.storage.compact_purge and self.input.write_mode != UPSERT:
            raise ConfigError(
                "--compact-purge erases superseded documents: it needs --write-mode upsert"
            )
        _check_positive("max key bytes", self.input.max_key_bytes)
        self._validate_chunking()
        _check_positive("view sync interval (s)", self.storage.view_sync_interval_s)
        _check_choice("precision", m.precision, PRECISIONS)
        _check_choice("device", m.device, DEVICES)
        _check_choice("shapes", m.shapes, SHAPES)
        _check_choice("tokenizer process", m.tokenizer_process, TOKENIZER_PROCESS)
        dlq = self.input.dlq_topic
        if dlq is not None:
            _check_topic_name(dlq)
            if dlq in self.topics:
                raise ConfigError("the dead-letter topic must not be one of the input topics")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics port {self.metrics_port} is not a TCP port")
        if self.input.text_field == self.input.id_field:
            raise ConfigError("--text-field and --id-field must differ")
        check_cache_spec(self.cache.spec)
        parse_cache_size(self.cache.size)

    def _validate_chunking(self) -> None:
        i = self.input
        _check_choice("chunk overflow", i.chunk_overflow, OVERFLOWS)
        if not 1 <= i.max_chunks <= MAX_CHUNKS_LIMIT:
            raise ConfigError(f"--max-chunks must be 1 to {MAX_CHUNKS_LIMIT}, got {i.max_chunks}")
        if i.chunk_overlap < 0:
            raise ConfigError(f"--chunk-overlap must be 0 or more, got {i.chunk_overlap}")
        if i.chunk_tokens is None:
            if i.chunk_overlap:
                raise ConfigError("--chunk-overlap cuts chunks: it needs --chunk-tokens")
            return
        _check_positive("chunk tokens", i.chunk_tokens)
        if i.chunk_overlap >= i.chunk_tokens:
            raise ConfigError(
                f"--chunk-overlap {i.chunk_overlap} must be smaller than --chunk-tokens "
                f"{i.chunk_tokens}: each window must move on"
            )

    @property
    def chunking(self) -> Chunking | None:
        """How long texts are cut into chunks; None: they are not."""
        i = self.input
        if i.chunk_tokens is None:
            return None
        return Chunking(i.chunk_tokens, i.chunk_overlap, i.max_chunks, i.chunk_overflow)

    @property
    def documents(self) -> DocumentKeys | None:
        """How records name their documents in upsert mode; None in append mode."""
        if self.input.write_mode != UPSERT:
            return None
        return DocumentKeys(self.input.document_key, self.input.max_key_bytes)

    @property
    def dead_letter_topic(self) -> str:
        return self.input.dlq_topic or f"{self.topics[0]}.dlq"

    @classmethod
    def default_of(cls, option: str) -> Any:
        """An option's default, for the CLI's --help and the benchmark's defaults."""
        if option in OPTION_FIELDS:
            group, name = OPTION_FIELDS[option]
            return GROUPS[group].__dataclass_fields__[name].default
        return cls.__dataclass_fields__[option].default

    def redacted(self) -> dict[str, Any]:
        """The effective configuration as a dict, secrets replaced, for the start-up log."""
        return redact(dataclasses.asdict(self))


def flatten_run_table(table: Mapping[str, Any], path: str) -> dict[str, Any]:
    """A file's [run] table with its [run.<group>] tables (batching, model, ...) taken
    in: the options by the names the flags have, each given once and in its group."""
    flat = {key: value for key, value in table.items() if not isinstance(value, Mapping)}
    twice = []
    for key, value in table.items():
        if not isinstance(value, Mapping):
            continue
        if key not in GROUPS:
            raise ConfigError(f"{path}: [run.{key}] is not one of {', '.join(GROUPS)}")
        for option, option_value in value.items():
            if OPTION_FIELDS.get(option, ("",))[0] != key:
                raise ConfigError(f"{path}: {option!r} is not an option of [run.{key}]")
            if option in flat:
                twice.append(option)
            flat[option] = option_value
    if twice:
        raise ConfigError(f"{path}: {', '.join(twice)} given both in [run] and in its group")
    return flat


def redact(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {
            k: (
                "***"
                if k in _SECRET_FIELDS and v is not None
                else redact_url(v)
                if k in _URL_FIELDS and isinstance(v, str)
                else redact(v)
            )
            for k, v in value.items()
        }
    if isinstance(value, Path):
        return str(value)
    if type(value).__name__ == "ObjectStore":  # an s3:// output: its URL (no secrets in it)
        return str(value)
    if isinstance(value, tuple | list):
        return [redact(v) for v in value]
    return value


def redact_url(url: str) -> str:
    """A URL with its password (if any) replaced: redis://user:***@host:6379/0."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest = re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", rest)  # redis://h?password=x
    # Hosts and paths hold no "@": the last one before the query ends the userinfo,
    # whatever a raw password holds ("/" included).
    head, q, query = rest.partition("?")
    userinfo, at, location = head.rpartition("@")
    if not at:
        return f"{scheme}://{rest}"
    user, colon, _ = userinfo.partition(":")
    # A bare userinfo (redis://secret@host) is a password to some clients: hidden too.
    return f"{scheme}://{user + ':' if colon else ''}***@{location}{q}{query}"


def load_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a TOML configuration file; errors name the file and the problem."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"configuration file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"configuration file {path} is not valid TOML: {exc}") from exc
    return {_option_key(k): _normalise(v) for k, v in data.items()}


def _normalise(value: Any) -> Any:
    if isinstance(value, dict):
        return {_option_key(k): _normalise(v) for k, v in value.items()}
    return value


def _option_key(key: str) -> str:
    # TOML users write either batch-size or batch_size; click wants batch_size.
    return key.replace("-", "_")


def _check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} {value!r} is not one of {', '.join(choices)}")


def _check_topic_name(topic: str) -> None:
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
    if not topic or len(topic) > 249 or not set(topic) <= allowed or topic in (".", ".."):
        raise ConfigError(f"{topic!r} is not a valid Kafka topic name")


def parse_cache_size(value: str | int) -> tuple[int | None, int | None]:
    """`--cache-size`: a plain number of entries ("50000"), or bytes with a unit
    ("32MiB", "64MB", "1GiB", "500k"). Returns (entries, bytes), one of them None."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"--cache-size must be positive, got {value}")
        return value, None
    match = _SIZE.match(str(value))
    if not match:
        raise ConfigError(
            f"--cache-size {value!r} is neither a number of entries (50000) nor a size "
            "with a unit (32MiB, 64MB, 1GiB)"
        )
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    if not unit:
        if not number.is_integer() or number <= 0:
            raise ConfigError(f"--cache-size {value!r}: a number of entries is a positive integer")
        return int(number), None
    base = 1024 if "i" in unit else 1000
    size = int(number * base ** "bkmgt".index(unit[0]))
    if size <= 0:
        raise ConfigError(f"--cache-size must be positive, got {value!r}")
    return None, size


def check_cache_spec(spec: str) -> None:
    """`--cache`: off, lru, or a Redis URL (redis://, rediss://, unix://)."""
    if spec in (CACHE_OFF, CACHE_LRU) or spec.startswith(REMOTE_SCHEMES):
        return
    raise ConfigError(
        f"--cache {redact_url(spec)!r} is not one of off, lru, redis://HOST:PORT/DB "
        "(also rediss:// and unix://)"
    )
