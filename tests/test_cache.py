"""The embedding cache by content (pipeline.model.cache): keys, the LRU, embed_cached on a
real (tiny) model, the Redis tier against a real redis-server, outages (a closed
port, a server that never answers, a server stopped mid-run), and a worker's
Parquet rows with and without the cache against the real broker."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import threading
import time
import tracemalloc
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core.config import WorkerConfig, check_cache_spec, parse_cache_size, redact_url
from pipeline.core.errors import ConfigError
from pipeline.core.metrics import WorkerMetrics
from pipeline.core.model_info import ModelInfo
from pipeline.model.cache import (
    BREAKER_FIRST_S,
    CacheStats,
    EmbeddingCache,
    LruCache,
    RedisCache,
    embed_cached,
    model_fingerprint,
    text_keys,
)
from tests.helpers import (
    REPO,
    committed_offsets,
    corpus_records,
    duplicates,
    output_rows,
    publish_json,
    run_until_end,
    start_worker,
    stop,
)

INFO = ModelInfo("m", "/models/m", "sha256:abc", 4, "mean", True, 128, "fp32", "cpu")


def vec(*values: float) -> bytes:
    return np.array(values, dtype=np.float32).tobytes()


# ------------------------------------------------------------------ keys and sizes


def test_fingerprint_covers_every_identity_item_but_the_device() -> None:
    base = model_fingerprint(INFO)
    assert model_fingerprint(dataclasses.replace(INFO, device="cuda")) == base
    assert model_fingerprint(dataclasses.replace(INFO, path="/elsewhere")) == base
    for change in [
        {"name": "other"},
        {"revision": "sha256:def"},
        {"dim": 8},
        {"pooling": "cls"},
        {"normalize": False},
        {"max_length": 256},
        {"precision": "bf16"},
        {"document_prompt": "passage: "},
    ]:
        assert model_fingerprint(dataclasses.replace(INFO, **change)) != base, change
    # Items added to the metadata later (a prompt) count without a change in the cache.
    metadata = INFO.as_metadata()
    assert model_fingerprint(metadata) == base
    assert model_fingerprint({**metadata, "prompt": "query: "}) != base
    assert model_fingerprint({**metadata, "prompt": "passage: "}) != model_fingerprint(
        {**metadata, "prompt": "query: "}
    )


def test_keys_are_the_exact_text_under_the_model() -> None:
    a, b = model_fingerprint(INFO), model_fingerprint(dataclasses.replace(INFO, name="n"))
    texts = ["Hello", "hello", "Hello ", "Hello", "héllo", "\ud800 lone surrogate", ""]
    keys = text_keys(a, texts)
    assert keys[0] == keys[3]
    assert len(set(keys)) == len(texts) - 1
    assert all(len(k) == 20 for k in keys)
    assert text_keys(b, ["Hello"])[0] != keys[0]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("50000", (50000, None)),
        (1000, (1000, None)),
        ("32MiB", (None, 32 << 20)),
        ("64MB", (None, 64_000_000)),
        ("64mb", (None, 64_000_000)),
        ("1.5GiB", (None, 3 << 29)),
        ("500k", (None, 500_000)),
        ("4096b", (None, 4096)),
    ],
)
def test_cache_size_in_entries_or_bytes(value: str | int, expected: tuple) -> None:
    assert parse_cache_size(value) == expected


@pytest.mark.parametrize("value", ["0", 0, "-5", "1.5", "lots", "0MiB", "12 parsecs"])
def test_cache_size_rejects(value: str | int) -> None:
    with pytest.raises(ConfigError, match="cache-size"):
        parse_cache_size(value)


def test_cache_spec_and_config() -> None:
    for ok in ["off", "lru", "redis://h:6379/0", "rediss://u:p@h/1", "unix:///run/redis.sock"]:
        check_cache_spec(ok)
    with pytest.raises(ConfigError, match="--cache 'memcached://u:\\*\\*\\*@h'"):
        check_cache_spec("memcached://u:secret@h")  # the message hides the password
    base = {"topics": ("t",), "group": "g", "output": Path("/tmp/o")}
    assert WorkerConfig.of(**base).cache.spec == "lru"
    for bad, message in [
        ({"cache": "yes"}, "--cache"),
        ({"cache_size": "big"}, "cache-size"),
        ({"cache_timeout_ms": 0}, "cache timeout"),
        ({"cache_ttl_s": -1.0}, "cache TTL"),
    ]:
        with pytest.raises(ConfigError, match=message):
            WorkerConfig.of(**base, **bad)


def test_redis_passwords_are_redacted_in_the_logged_config() -> None:
    config = WorkerConfig.of(
        topics=("t",), group="g", output=Path("/o"), cache="redis://app:s3cr/et@cache-1:6379/2"
    )
    text = json.dumps(config.redacted())
    assert "s3cr" not in text
    assert config.redacted()["cache"]["spec"] == "redis://app:***@cache-1:6379/2"
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://pw@h:1/0") == "redis://***@h:1/0"
    assert redact_url("rediss://h:1/0?password=pw&x=1") == "rediss://h:1/0?password=***&x=1"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert redact_url("lru") == "lru"


def test_cli_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from pipeline import cli

    for name in list(os.environ):
        if name.startswith("PIPELINE_"):
            monkeypatch.delenv(name)
    configs: list[WorkerConfig] = []
    monkeypatch.setattr(cli.run, "run_worker", configs.append)
    run = ["run", "--topic", "t", "--group", "g", "--output", "/tmp/o"]
    flags = ["--cache", "redis://h:1/0", "--cache-size", "1000", "--cache-ttl-s", "3600"]
    result = CliRunner().invoke(cli.main, [*run, *flags, "--cache-timeout-ms", "50"])
    assert result.exit_code == 0, result.output
    env = {"PIPELINE_CACHE": "off", "PIPELINE_CACHE_SIZE": "8MiB"}
    result = CliRunner().invoke(cli.main, run, env=env)
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli.main, run)
    assert result.exit_code == 0, result.output
    first, second, third = configs
    assert (first.cache.spec, first.cache.size, first.cache.ttl_s, first.cache.timeout_ms) == (
        "redis://h:1/0",
        "1000",
        3600.0,
        50,
    )
    assert (second.cache.spec, second.cache.size) == ("off", "8MiB")
    assert (third.cache.spec, third.cache.size, third.cache.ttl_s) == ("lru", "32MiB", None)
    bad = CliRunner().invoke(cli.main, [*run, "--cache", "sometimes"])
    assert bad.exit_code == 64 and "--cache" in bad.output


# ------------------------------------------------------------------ the LRU


def test_lru_evicts_the_least_recently_used_entry() -> None:
    lru = LruCache(max_entries=3)
    lru.put_many([(b"a", vec(1)), (b"b", vec(2)), (b"c", vec(3))])
    assert lru.get_many([b"a"]) == {b"a": vec(1)}  # a is now the most recent
    lru.put_many([(b"d", vec(4))])
    assert set(lru.get_many([b"a", b"b", b"c", b"d"])) == {b"a", b"c", b"d"}
    assert (len(lru), lru.evictions) == (3, 1)
    lru.put_many([(b"a", vec(9))])  # an overwrite is no new entry
    assert lru.get_many([b"a"]) == {b"a": vec(9)}
    assert len(lru) == 3


def test_lru_bound_in_bytes_holds_its_memory() -> None:
    bound = 2 << 20
    lru = LruCache(max_bytes=bound)
    keys = text_keys("f" * 32, [f"text {i}" for i in range(20_000)])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for start in range(0, len(keys), 1000):
            lru.put_many(
                (k, np.full(384, i, np.float32).tobytes())
                for i, k in enumerate(keys[start : start + 1000])
            )
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert lru.bytes <= bound
    assert 1000 < len(lru) < 2000  # ~1,750 vectors of 384 floats in 2 MiB
    assert grown < bound * 1.1, f"{grown} bytes held for a {bound}-byte bound"
    assert lru.get_many([keys[-1]]) and not lru.get_many([keys[0]])
    lru.put_many([(b"huge", b"\0" * (bound + 1))])  # larger than the cache: not kept
    assert not lru.get_many([b"huge"]) and lru.get_many([keys[-1]])


# ------------------------------------------------------------------ embed_cached on a model


@pytest.fixture(scope="module")
def tiny(tiny_model: str):
    from pipeline.model.embedder import Embedder

    embedder = Embedder.load(tiny_model, precision="fp32", device="cpu")
    yield embedder
    embedder.close()


def _lru_cache(embedder, **kwargs) -> EmbeddingCache:
    return EmbeddingCache(
        model_fingerprint(embedder.info), embedder.info.dim, LruCache(max_entries=10_000), **kwargs
    )


def test_only_distinct_misses_reach_the_model_and_rows_keep_their_order(tiny) -> None:
    texts = ["alpha beta", "gamma", "alpha beta", "delta epsilon zeta", "gamma", "alpha beta"]
    cache = _lru_cache(tiny)
    vectors, stats, found = embed_cached(tiny, cache, texts, tiny.tokenize(texts))
    assert (found.misses, found.batch_repeats, found.lru_hits) == (3, 3, 0)
    assert stats.real_tokens == int(tiny.tokenize(texts[:2] + texts[3:4]).lengths.sum())
    alone = tiny.embed(texts)
    np.testing.assert_allclose(vectors, alone, atol=1e-5)
    assert np.array_equal(vectors[0], vectors[2]) and np.array_equal(vectors[1], vectors[4])
    # A later batch: what was seen comes from the LRU bit for bit; only the new text is run.
    later = ["gamma", "eta theta", "alpha beta"]
    again, stats, found = embed_cached(tiny, cache, later, tiny.tokenize(later))
    assert (found.misses, found.lru_hits, found.batch_repeats) == (1, 2, 0)
    assert np.array_equal(again[0], vectors[1]) and np.array_equal(again[2], vectors[0])
    np.testing.assert_allclose(again[1], tiny.embed(["eta theta"])[0], atol=1e-5)
    assert cache.stats.hits == 5 and cache.stats.misses == 4
    # Everything cached: no forward pass at all.
    _, stats, found = embed_cached(tiny, cache, later, tiny.tokenize(later))
    assert stats.forward_passes == 0 and found.hits == 3
    empty, stats, found = embed_cached(tiny, cache, [], tiny.tokenize([]))
    assert empty.shape == (0, tiny.info.dim) and found.lookups == 0


def test_metrics_count_hits_by_tier_and_misses(tiny) -> None:
    metrics = WorkerMetrics()
    cache = _lru_cache(tiny, metrics=metrics)
    for texts in (["a", "b", "a"], ["b", "c"]):
        embed_cached(tiny, cache, texts, tiny.tokenize(texts))
    value = metrics.registry.get_sample_value
    assert value("pipeline_cache_hits_total", {"tier": "batch"}) == 1
    assert value("pipeline_cache_hits_total", {"tier": "lru"}) == 1
    assert value("pipeline_cache_misses_total") == 3
    assert value("pipeline_cache_entries") == 3
    assert value("pipeline_cache_bytes") > 3 * tiny.info.dim * 4


# ------------------------------------------------------------------ the Redis tier


def _redis_cache(url: str, **kwargs) -> RedisCache:
    return RedisCache(url, namespace=f"test:{uuid.uuid4().hex}:".encode(), **kwargs)


@pytest.mark.redis
def test_redis_round_trip_raw_float32_with_ttl(redis_url: str) -> None:
    import redis

    remote = _redis_cache(redis_url, ttl_s=60)
    items = [(f"k{i}".encode(), vec(i, i + 0.5)) for i in range(1200)]  # several chunks
    remote.put_many(items)
    keys = [k for k, _ in items] + [b"absent"]
    assert remote.get_many(keys) == dict(items)
    client = redis.Redis.from_url(redis_url)
    raw = client.get(remote.namespace + b"k7")
    assert np.frombuffer(raw, np.float32).tolist() == [7.0, 7.5]
    assert 0 < client.pttl(remote.namespace + b"k7") <= 60_000
    forever = _redis_cache(redis_url)
    forever.put_many([(b"x", vec(1))])
    assert client.pttl(forever.namespace + b"x") == -1  # no TTL: the server's eviction


@pytest.mark.redis
def test_workers_share_vectors_through_redis(tiny, redis_url: str) -> None:
    fingerprint = model_fingerprint(tiny.info)
    namespace = f"test:{uuid.uuid4().hex}:".encode()
    texts = [f"shared text number {i}" for i in range(50)]

    def worker_cache() -> EmbeddingCache:  # its own LRU, the same Redis
        remote = RedisCache(redis_url, namespace=namespace)
        return EmbeddingCache(fingerprint, tiny.info.dim, LruCache(max_entries=100), remote)

    first, second = worker_cache(), worker_cache()
    a, _, found_a = embed_cached(tiny, first, texts, tiny.tokenize(texts))
    b, stats, found_b = embed_cached(tiny, second, texts, tiny.tokenize(texts))
    assert found_a.misses == 50 and found_b.remote_hits == 50 and stats.forward_passes == 0
    assert np.array_equal(a, b)
    # A value of the wrong size (another writer, a damaged key) is a miss, not a vector.
    third = worker_cache()
    (bad,) = third.keys(["shared text number 0"])
    third.remote.put_many([(bad, b"\0" * 3)])
    c, _, found_c = embed_cached(tiny, third, texts[:1], tiny.tokenize(texts[:1]))
    assert found_c.misses == 1 and found_c.remote_hits == 0
    np.testing.assert_allclose(c[0], a[0], atol=1e-5)


# ------------------------------------------------------------------ outages


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A TCP port that accepts connections and never answers: every call times out."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stopping = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stopping.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    stopping.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.parametrize("down", ["closed port", "black hole"])
def test_an_unreachable_redis_costs_one_timeout_then_the_breaker(tiny, down, request) -> None:
    url = (
        f"redis://127.0.0.1:{_free_port()}/0"
        if down == "closed port"
        else request.getfixturevalue("black_hole")
    )
    now = [100.0]
    metrics = WorkerMetrics()
    remote = RedisCache(url, namespace=b"t:", timeout_s=0.2)
    cache = _lru_cache(tiny, remote=remote, metrics=metrics, clock=lambda: now[0])
    texts = [f"text {i}" for i in range(20)]
    started = time.monotonic()
    vectors, _, found = embed_cached(tiny, cache, texts, tiny.tokenize(texts))
    first = time.monotonic() - started
    np.testing.assert_allclose(vectors, tiny.embed(texts), atol=1e-5)
    assert (found.misses, found.remote_errors, found.by_op) == (20, 1, {"get": 1})
    assert first < 2.0, f"a failed lookup took {first:.2f}s (timeout 0.2s)"
    # While the breaker is open Redis is not asked at all: no second timeout.
    more = [f"more {i}" for i in range(20)]
    started = time.monotonic()
    _, _, found = embed_cached(tiny, cache, more, tiny.tokenize(more))
    assert found.remote_errors == 0 and time.monotonic() - started < 1.0
    now[0] += BREAKER_FIRST_S  # the breaker lets one call through again: it fails
    _, _, found = embed_cached(tiny, cache, ["x"], tiny.tokenize(["x"]))
    assert found.remote_errors == 1
    assert metrics.registry.get_sample_value("pipeline_cache_errors_total", {"op": "get"}) == 2
    assert metrics.registry.get_sample_value("pipeline_cache_remote_up") == 0
    assert cache.stats.remote_errors == 2 and cache.stats.misses == 41


def test_a_failed_call_is_logged_once_a_minute(tiny, caplog) -> None:
    now = [0.0]
    remote = RedisCache(f"redis://127.0.0.1:{_free_port()}/0", namespace=b"t:", timeout_s=0.2)
    cache = _lru_cache(tiny, remote=remote, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="pipeline.model.cache"):
        for i in range(10):
            now[0] += 31  # past the breaker's longest wait: every call is tried and fails
            embed_cached(tiny, cache, [f"t{i}"], tiny.tokenize([f"t{i}"]))
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert cache.stats.remote_errors == 10
    assert len(warnings) == 5  # one per 60 s of failures
    assert "embedding without it" in warnings[0].getMessage()
    assert "more failure(s)" in warnings[1].getMessage()


# ------------------------------------------------------------------ a worker, real broker


_DONE = re.compile(r"done: .*; cache: (\d+) of (\d+) records from the cache")


def _corpus_with_repeats(n: int, repeat_share: float, seed: int = 0) -> list[dict]:
    """n records, `repeat_share` of them repeating an earlier record's text exactly."""
    rng = np.random.default_rng(seed)
    fresh = corpus_records(n, seed=seed)
    records, texts = [], []
    for i in range(n):
        if texts and rng.random() < repeat_share:
            text = texts[int(rng.integers(len(texts)))]
        else:
            text = fresh[len(texts)]["text"]
            texts.append(text)
        records.append({"id": f"doc-{i}", "text": text, "lang": "en"})
    return records


def _rows(output: Path) -> dict[tuple, dict]:
    rows = {}
    for path in sorted((output / "vectors").glob("*.parquet")):
        for row in pq.read_table(path).to_pylist():
            rows[(row["topic"], row["partition"], row["offset"])] = row
    return rows


def _cache_counts(stderr: str) -> tuple[int, int]:
    match = _DONE.search(stderr)
    assert match, stderr[-2000:]
    return int(match.group(1)), int(match.group(2))


@pytest.mark.integration
@pytest.mark.redis
def test_parquet_rows_are_the_same_with_and_without_the_cache(
    broker, make_topic, tmp_path, redis_url
) -> None:
    """The real model: everything but the vectors equal; the vectors equal to the
    last bits, as they already are between two runs of different batch sizes."""
    topic = make_topic(partitions=2)
    records = _corpus_with_repeats(240, 0.3)
    repeats = len(records) - len({r["text"] for r in records})
    publish_json(broker, topic, records, partitions=2)
    runs = {
        "off": ("--cache", "off", "--batch-size", "64"),
        "off-b48": ("--cache", "off", "--batch-size", "48"),
        "lru": ("--cache", "lru", "--batch-size", "64"),
        "redis": ("--cache", redis_url, "--batch-size", "64"),
    }
    rows = {}
    for name, flags in runs.items():
        out = tmp_path / name
        result = run_until_end(broker, topic, f"g-{uuid.uuid4().hex[:8]}", out, *flags)
        assert result.returncode == 0, result.stderr[-3000:]
        rows[name] = _rows(out)
        if name == "lru":
            assert _cache_counts(result.stderr) == (repeats, len(records))
        if name == "redis":
            hits, lookups = _cache_counts(result.stderr)
            assert lookups == len(records) and hits >= repeats
    expected = {(topic, i % 2, i // 2) for i in range(len(records))}
    baseline = rows["off"]
    assert set(baseline) == expected
    columns = [c for c in next(iter(baseline.values())) if c != "embedding"]
    drift = {}
    for name in ("off-b48", "lru", "redis"):
        assert set(rows[name]) == expected
        for key, row in baseline.items():
            assert {c: rows[name][key][c] for c in columns} == {c: row[c] for c in columns}
        a = np.array([baseline[k]["embedding"] for k in sorted(expected)], np.float32)
        b = np.array([rows[name][k]["embedding"] for k in sorted(expected)], np.float32)
        drift[name] = float(np.abs(a - b).max())
    # Batch composition alone moves fp32 vectors by ~1e-7; the cache by no more.
    assert max(drift.values()) < 1e-5, drift
    # With the cache, a repeated text gets the very same vector as its first record.
    by_text: dict[str, list] = {}
    for row in rows["lru"].values():
        by_text.setdefault(row["text"], []).append(row["embedding"])
    assert all(all(v == vs[0] for v in vs) for vs in by_text.values())


@pytest.mark.integration
def test_worker_embeds_everything_through_an_unreachable_redis(
    broker, make_topic, tmp_path, tiny_model, black_hole
) -> None:
    topic = make_topic(partitions=2)
    records = _corpus_with_repeats(300, 0.3)
    publish_json(broker, topic, records, partitions=2)
    seconds = {}
    for name, cache in (("off", "off"), ("down", black_hole)):
        out = tmp_path / name
        flags = ("--model", tiny_model, "--batch-size", "32", "--cache", cache)
        flags += ("--cache-timeout-ms", "300")
        started = time.monotonic()
        result = run_until_end(broker, topic, f"g-{uuid.uuid4().hex[:8]}", out, *flags)
        seconds[name] = time.monotonic() - started
        assert result.returncode == 0, result.stderr[-3000:]
        rows = output_rows(out)
        assert duplicates(rows) == [] and len(rows) == len(records)
    errors = re.search(r"(\d+) redis errors", result.stderr)
    assert errors and int(errors.group(1)) > 0, result.stderr[-2000:]
    assert "embedding without it" in result.stderr
    # The start-up ping, then at most one 0.3 s timeout per breaker interval.
    assert seconds["down"] < seconds["off"] + 5, seconds


def _dev_redis(port: int, command: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIPELINE_REDIS_PORT": str(port)}
    script = str(REPO / "scripts" / "dev-redis.sh")
    return subprocess.run([script, command], env=env, capture_output=True, text=True)


def _metric(port: int, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith(f"{name}{labels} "))
    return float(line.split()[-1])


@pytest.mark.integration
@pytest.mark.redis
def test_redis_stopped_and_restarted_under_a_running_worker(
    broker, make_topic, group_id, tmp_path, tiny_model, redis_url
) -> None:
    port = _free_port()
    assert _dev_redis(port, "start").returncode == 0  # a private server, to stop at will
    topic = make_topic(partitions=2)
    metrics_port = _free_port()
    log = tmp_path / "worker.log"
    flags = ("--model", tiny_model, "--cache", f"redis://127.0.0.1:{port}/0")
    flags += ("--metrics-port", str(metrics_port))
    worker = start_worker(broker, topic, group_id, tmp_path / "out", *flags, log=log)
    total = 0
    try:
        for phase in ("up", "down", "back"):
            if phase == "down":
                assert _dev_redis(port, "stop").returncode == 0
            if phase == "back":
                assert _dev_redis(port, "start").returncode == 0
            batch = corpus_records(60, seed=len(phase))
            publish_json(broker, topic, batch, partitions=2)
            total += len(batch)
            _wait_for(lambda n=total: _committed(broker, group_id, topic) == n)
            if phase == "down":
                assert _metric(metrics_port, "pipeline_cache_remote_up") == 0
                assert _metric(metrics_port, "pipeline_cache_errors_total", '{op="get"}') >= 1
            # Back: once the breaker's wait (doubled per failure) is over, a batch
            # finds the server again.
            deadline = time.monotonic() + 90
            while phase == "back" and _metric(metrics_port, "pipeline_cache_remote_up") != 1:
                assert time.monotonic() < deadline, "the worker never used Redis again"
                publish_json(broker, topic, corpus_records(4, seed=total), partitions=2)
                total += 4
                _wait_for(lambda n=total: _committed(broker, group_id, topic) == n)
                time.sleep(1)
    finally:
        code = stop(worker)
        _dev_redis(port, "wipe")
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "answers again" in text, text[-3000:]
    rows = output_rows(tmp_path / "out")
    assert duplicates(rows) == [] and len(rows) == total


def _committed(broker: str, group: str, topic: str) -> int:
    return sum(v or 0 for v in committed_offsets(broker, group, topic).values())


def _wait_for(condition, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    pytest.fail("timed out")


def test_cache_stats_summary() -> None:
    stats = CacheStats(batch_repeats=2, lru_hits=3, remote_hits=5, misses=10, remote_errors=1)
    assert stats.hits == 10 and stats.hit_rate == 0.5
    assert "10 of 20 records from the cache (50.0%" in stats.summary(remote=True)
    assert "redis" not in stats.summary(remote=False)
