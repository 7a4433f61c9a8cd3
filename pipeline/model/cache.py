"""Embedding cache by content: a text met again is not embedded again.

A vector is the model's function of the exact text, so it is cached under a hash
of both: the model's identity (every item of `ModelInfo.as_metadata()` but the
device: name, weights hash, pooling, normalisation, dim, maximum length,
precision, and whatever identity later joins it, prompts included) and the text's
exact UTF-8 bytes. Two tiers sit behind one narrow interface (`get_many(keys)`
-> found, `put_many(items)`), values being the vectors' raw float32 bytes:

- an in-process LRU, bounded in entries or in bytes (`--cache-size`), always in
  front: repeats within a batch and across recent batches;
- optionally Redis (`--cache redis://host:port/db`), shared by every worker and
  every run of the same model: one MGET per batch for what the LRU lacks, one
  pipelined SET (with `--cache-ttl-s`) for what the model computed.

The shared tier is an optimisation, never a dependency: its calls have short
socket timeouts and no retries, and a failure opens a breaker for a growing
interval (1 s doubling to 30 s) during which Redis is not asked at all. The
batch is embedded without it, the failure counted and logged (once a minute at
most). A cache outage costs at most one timeout per breaker interval.

`embed_cached` is the embed stage's path: the batch's texts are hashed, the
distinct ones looked up, only the misses reach the model (in length order, as
always), and the rows come back in the batch's order. A cached vector is one the
model computed for the same text; it can differ from the vector this batch's
passes would compute only in the last bits, as vectors already do between batch
compositions (~1e-7 in fp32; tests/test_cache.py measures both).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.core.config import CACHE_LRU, CACHE_OFF, parse_cache_size, redact_url
from pipeline.core.errors import ConfigError
from pipeline.core.retry import Backoff, RetryGate

if TYPE_CHECKING:
    from pipeline.core.config import WorkerConfig
    from pipeline.core.metrics import WorkerMetrics
    from pipeline.model.embedder import Embedder, EmbedStats, ModelInfo, Tokenized

log = logging.getLogger(__name__)


# Bytes an LRU entry costs beyond its vector and key: the key and value objects
# headers and the ordered dict's slot and link (tracemalloc: ~140; rounded up).
ENTRY_OVERHEAD = 200
# Keys per MGET / per pipelined batch of SETs.
REMOTE_CHUNK = 512
# The breaker: Redis is not asked for this long after a failure, doubling per
# failure up to the cap.
BREAKER_FIRST_S = 1.0
BREAKER_MAX_S = 30.0
LOG_EVERY_S = 60.0


class CacheError(Exception):
    """The shared tier failed (connection, timeout, protocol); the caller embeds."""


def model_fingerprint(info: ModelInfo | Mapping[str, Any]) -> str:
    """The model's identity for cache keys: every metadata item but the device,
    sorted and hashed, so that identity fields added later count without a change
    here. A vector computed on a GPU serves a CPU worker and the other way round."""
    metadata = info if isinstance(info, Mapping) else info.as_metadata()
    items = sorted((str(k), str(v)) for k, v in metadata.items() if k != "device")
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:32]


def text_keys(fingerprint: str, texts: Iterable[str]) -> list[bytes]:
    """20-byte keys: BLAKE2b of each text's exact UTF-8 bytes, keyed by the model."""
    secret = fingerprint.encode()
    blake = hashlib.blake2b
    return [
        blake(t.encode("utf-8", "surrogatepass"), digest_size=20, key=secret).digest()
        for t in texts
    ]


class LruCache:
    """An in-process LRU of raw vectors, bounded in entries or in bytes (or both)."""

    def __init__(self, max_entries: int | None = None, max_bytes: int | None = None) -> None:
        if max_entries is None and max_bytes is None:
            raise ValueError("an LRU needs a bound: entries or bytes")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._data)

    def get_many(self, keys: Iterable[bytes]) -> dict[bytes, bytes]:
        found: dict[bytes, bytes] = {}
        with self._lock:
            data = self._data
            for key in keys:
                value = data.get(key)
                if value is not None:
                    data.move_to_end(key)
                    found[key] = value
        return found

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        with self._lock:
            data = self._data
            for key, value in items:
                old = data.pop(key, None)
                if old is not None:
                    self.bytes -= _entry_bytes(key, old)
                size = _entry_bytes(key, value)
                if self.max_bytes is not None and size > self.max_bytes:
                    continue  # larger than the whole cache: not kept
                data[key] = value
                self.bytes += size
            self._evict()

    def _evict(self) -> None:
        data = self._data
        while data and (
            (self.max_entries is not None and len(data) > self.max_entries)
            or (self.max_bytes is not None and self.bytes > self.max_bytes)
        ):
            key, value = data.popitem(last=False)
            self.bytes -= _entry_bytes(key, value)
            self.evictions += 1


def _entry_bytes(key: bytes, value: bytes) -> int:
    return len(key) + len(value) + ENTRY_OVERHEAD


class RedisCache:
    """The shared tier: raw float32 vectors in Redis under `<namespace><key>`.

    Every call either answers within the socket timeout or raises CacheError: no
    retries (redis-py retries connection errors three times by default)."""

    def __init__(
        self,
        url: str,
        namespace: bytes,
        ttl_s: float | None = None,
        timeout_s: float = 0.5,
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise ConfigError(
                "--cache redis://... needs the redis client: "
                "pip install 'embedding-pipeline[cache]'"
            ) from exc
        self.url = redact_url(url)
        self.namespace = namespace
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
                health_check_interval=0,
                client_name="embedding-pipeline",
            )
        except ValueError as exc:
            raise ConfigError(f"--cache {self.url}: {exc}") from exc

    def ping(self) -> None:
        try:
            self._client.ping()
        except self._errors as exc:
            raise CacheError(_describe(exc)) from exc

    def get_many(self, keys: list[bytes]) -> dict[bytes, bytes]:
        if not keys:
            return {}
        names = [self.namespace + k for k in keys]
        try:
            pipe = self._client.pipeline(transaction=False)
            for start in range(0, len(names), REMOTE_CHUNK):
                pipe.mget(names[start : start + REMOTE_CHUNK])
            replies = pipe.execute()
        except self._errors as exc:
            raise CacheError(_describe(exc)) from exc
        found: dict[bytes, bytes] = {}
        values = (v for reply in replies for v in reply)
        for key, value in zip(keys, values, strict=True):
            if value is not None:
                found[key] = value
        return found

    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        if not items:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for n, (key, value) in enumerate(items, 1):
                pipe.set(self.namespace + key, value, px=self.ttl_ms)
                if n % REMOTE_CHUNK == 0:
                    pipe.execute()
            pipe.execute()
        except self._errors as exc:
            raise CacheError(_describe(exc)) from exc

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self._client.close()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


@dataclass
class CacheStats:
    """Records by where their vector came from, and the shared tier's failures."""

    batch_repeats: int = 0  # a repeat of an earlier record of the same batch
    lru_hits: int = 0
    remote_hits: int = 0
    misses: int = 0  # embedded by the model
    remote_errors: int = 0
    by_op: dict[str, int] = field(default_factory=dict)

    @property
    def hits(self) -> int:
        return self.batch_repeats + self.lru_hits + self.remote_hits

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def add(self, other: CacheStats) -> None:
        self.batch_repeats += other.batch_repeats
        self.lru_hits += other.lru_hits
        self.remote_hits += other.remote_hits
        self.misses += other.misses
        self.remote_errors += other.remote_errors
        for op, n in other.by_op.items():
            self.by_op[op] = self.by_op.get(op, 0) + n

    def summary(self, remote: bool) -> str:
        parts = [
            f"{self.hits} of {self.lookups} records from the cache ({self.hit_rate:.1%}: "
            f"{self.batch_repeats} repeats in a batch, {self.lru_hits} lru"
        ]
        if remote:
            parts.append(f", {self.remote_hits} redis, {self.remote_errors} redis errors")
        return "".join(parts) + ")"


class EmbeddingCache:
    """The LRU with the shared tier behind it, for one model. Used by one thread
    (the embed stage); its counters may be read from others."""

    def __init__(
        self,
        fingerprint: str,
        dim: int,
        lru: LruCache,
        remote: RedisCache | None = None,
        metrics: WorkerMetrics | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.fingerprint = fingerprint
        self.dim = dim
        self.lru = lru
        self.remote = remote
        self.metrics = metrics
        self.stats = CacheStats()
        self._clock = clock
        self._breaker = RetryGate(Backoff(BREAKER_FIRST_S, 2.0, BREAKER_MAX_S))
        self._errors_unlogged = 0
        self._last_log = -LOG_EVERY_S
        if metrics is not None:
            metrics.cache_remote_up.set(1 if remote is not None else 0)

    def describe(self) -> str:
        bound = []
        if self.lru.max_entries is not None:
            bound.append(f"{self.lru.max_entries:,} entries")
        if self.lru.max_bytes is not None:
            bound.append(f"{self.lru.max_bytes / 2**20:,.1f} MiB")
        text = f"lru of {' / '.join(bound)}"
        if self.remote is not None:
            ttl = f", ttl {self.remote.ttl_ms / 1000:g}s" if self.remote.ttl_ms else ""
            text += f" in front of {self.remote.url}{ttl}"
        return f"{text} (model key {self.fingerprint[:12]})"

    def keys(self, texts: Iterable[str]) -> list[bytes]:
        return text_keys(self.fingerprint, texts)

    # -- the narrow interface ----------------------------------------------------------

    def get_many(self, keys: list[bytes], stats: CacheStats | None = None) -> dict[bytes, bytes]:
        """Vectors found for distinct `keys`, from the LRU or else the shared tier.
        Counts go into `stats` (the caller records them), else straight to the run's."""
        if stats is None:
            stats = CacheStats()
            found = self.get_many(keys, stats)
            self.record(stats)
            return found
        found = self.lru.get_many(keys)
        stats.lru_hits += len(found)
        if self.remote is not None and len(found) < len(keys) and self._remote_allowed():
            wanted = [k for k in keys if k not in found]
            try:
                remote = self.remote.get_many(wanted)
            except CacheError as exc:
                self._remote_failed("get", exc, stats)
            else:
                self._remote_ok()
                size = self.dim * 4
                good = {k: v for k, v in remote.items() if len(v) == size}
                found.update(good)
                stats.remote_hits += len(good)
                self.lru.put_many(good.items())
        return found

    def put_many(self, items: list[tuple[bytes, bytes]], stats: CacheStats | None = None) -> None:
        if stats is None:
            stats = CacheStats()
            self.put_many(items, stats)
            self.record(stats)
            return
        self.lru.put_many(items)
        if self.remote is not None and items and self._remote_allowed():
            try:
                self.remote.put_many(items)
            except CacheError as exc:
                self._remote_failed("put", exc, stats)
            else:
                self._remote_ok()

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()

    def check_remote(self) -> None:
        """A PING at start: says in the log whether the shared tier answers (the
        worker goes on either way)."""
        if self.remote is None:
            return
        try:
            self.remote.ping()
        except CacheError as exc:
            stats = CacheStats()
            self._remote_failed("ping", exc, stats)
            self.record(stats)
        else:
            log.info("cache: %s answers", self.remote.url)

    # -- the breaker -------------------------------------------------------------------

    def _remote_allowed(self) -> bool:
        return self._breaker.ready(self._clock())

    def _remote_ok(self) -> None:
        breaker = self._breaker
        if breaker.failing_since is not None:
            log.info(
                "cache: %s answers again after %.0fs (%d failed call(s) meanwhile)",
                self.remote.url if self.remote else "redis",
                self._clock() - breaker.failing_since,
                breaker.failures,
            )
            self._errors_unlogged = 0
            if self.metrics is not None:
                self.metrics.cache_remote_up.set(1)
        breaker.succeeded()

    def _remote_failed(self, op: str, exc: CacheError, stats: CacheStats) -> None:
        now = self._clock()
        stats.remote_errors += 1
        stats.by_op[op] = stats.by_op.get(op, 0) + 1
        if self._breaker.failing_since is None and self.metrics is not None:
            self.metrics.cache_remote_up.set(0)
        retry_in = self._breaker.failed(now)  # Redis is not asked again before then
        if now - self._last_log >= LOG_EVERY_S:
            more = f" ({self._errors_unlogged} more failure(s) since the last warning)"
            log.warning(
                "cache: %s %s failed (%s); embedding without it, next try in %.0fs%s",
                self.remote.url if self.remote else "redis",
                op,
                exc,
                retry_in,
                more if self._errors_unlogged else "",
            )
            self._last_log = now
            self._errors_unlogged = 0
        else:
            self._errors_unlogged += 1

    # -- accounting --------------------------------------------------------------------

    def record(self, stats: CacheStats) -> None:
        """Adds a batch's figures to the run's, and to the metrics."""
        self.stats.add(stats)
        m = self.metrics
        if m is None:
            return
        if stats.batch_repeats:
            m.cache_hits.labels("batch").inc(stats.batch_repeats)
        if stats.lru_hits:
            m.cache_hits.labels("lru").inc(stats.lru_hits)
        if stats.remote_hits:
            m.cache_hits.labels("redis").inc(stats.remote_hits)
        if stats.misses:
            m.cache_misses.inc(stats.misses)
        for op, n in stats.by_op.items():
            m.cache_errors.labels(op).inc(n)
        m.cache_entries.set(len(self.lru))
        m.cache_bytes.set(self.lru.bytes)


def embed_cached(
    embedder: Embedder,
    cache: EmbeddingCache,
    texts: list[str],
    tokens: Tokenized,
    between_passes: Callable[[], None] | None = None,
) -> tuple[np.ndarray, EmbedStats, CacheStats]:
    """`embedder.embed_tokens(tokens)` for a batch whose rows are `texts`, with only
    the texts the cache lacks reaching the model (each distinct one once). Rows in
    the batch's order; the EmbedStats are the model's, over the misses, with the
    seconds of the whole call."""
    from pipeline.model.embedder import Tokenized

    started = time.perf_counter()
    stats = CacheStats()
    keys = cache.keys(texts)
    slot: dict[bytes, int] = {}  # key -> its row in `unique`
    first_row: list[int] = []  # the batch row of each distinct key's first record
    rows = np.empty(len(keys), dtype=np.int64)
    for i, key in enumerate(keys):
        j = slot.get(key)
        if j is None:
            j = slot[key] = len(first_row)
            first_row.append(i)
        rows[i] = j
    unique = list(slot)
    stats.batch_repeats = len(keys) - len(unique)
    found = cache.get_many(unique, stats)
    pool = np.empty((len(unique), cache.dim), dtype=np.float32)
    todo = []
    for j, key in enumerate(unique):
        value = found.get(key)
        if value is None:
            todo.append(j)
        else:
            pool[j] = np.frombuffer(value, dtype=np.float32)
    source = [first_row[j] for j in todo]
    missing = Tokenized([tokens.ids[i] for i in source], tokens.lengths[source], truncated=0)
    vectors, embed_stats = embedder.embed_tokens(missing, between_passes=between_passes)
    pool[todo] = vectors
    stats.misses = len(todo)
    cache.put_many([(unique[j], pool[j].tobytes()) for j in todo], stats)
    cache.record(stats)
    yielded = embed_stats.yielded_s
    embed_stats.seconds = time.perf_counter() - started - yielded
    return pool[rows], embed_stats, stats


def open_cache(
    config: WorkerConfig, info: ModelInfo, metrics: WorkerMetrics | None = None
) -> EmbeddingCache | None:
    """The worker's cache as configured (None for --cache off)."""
    spec = config.cache.spec
    if spec == CACHE_OFF:
        return None
    entries, size = parse_cache_size(config.cache.size)
    fingerprint = model_fingerprint(info)
    remote = None
    if spec != CACHE_LRU:
        remote = RedisCache(
            spec,
            namespace=f"pipeline:emb:{fingerprint[:16]}:".encode(),
            ttl_s=config.cache.ttl_s,
            timeout_s=config.cache.timeout_ms / 1000,
        )
    cache = EmbeddingCache(fingerprint, info.dim, LruCache(entries, size), remote, metrics)
    log.info("cache: %s", cache.describe())
    cache.check_remote()
    return cache
