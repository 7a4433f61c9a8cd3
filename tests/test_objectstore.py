"""sinks/objectstore.py against a real S3 server (SeaweedFS, scripts/dev-s3.sh): every
test writes under a fresh prefix and reads back what it wrote."""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import ConfigError, OutputError
from sinks.objectstore import ObjectStore, S3Url, is_object_store_url

pytestmark = [pytest.mark.integration, pytest.mark.s3]


@pytest.fixture
def store(s3_url: str) -> Iterator[ObjectStore]:
    """A store on a fresh prefix (endpoint and credentials from the environment);
    whatever the test left there is deleted afterwards."""
    store = ObjectStore.from_url(s3_url)
    yield store
    for info in store.list():
        store.delete(info.key)


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert text and "\n" not in text, text
    return text


def test_put_if_absent_creates_once_and_keeps_the_first(store: ObjectStore) -> None:
    assert not store.exists("vectors/t-0-000.parquet")
    assert store.put_if_absent("vectors/t-0-000.parquet", b"first writer") is True
    assert store.put_if_absent("vectors/t-0-000.parquet", b"second writer!") is False
    assert store.get("vectors/t-0-000.parquet") == b"first writer"
    assert store.exists("vectors/t-0-000.parquet")
    assert store.size("vectors/t-0-000.parquet") == len(b"first writer")
    # A plain put replaces; a create still refuses afterwards.
    store.put("vectors/t-0-000.parquet", b"replaced")
    assert store.get("vectors/t-0-000.parquet") == b"replaced"
    assert store.put_if_absent("vectors/t-0-000.parquet", b"again") is False
    assert store.get("vectors/t-0-000.parquet") == b"replaced"


def test_racing_creators_exactly_one_wins(store: ObjectStore) -> None:
    # Several clients (as several workers would hold), several threads on each.
    stores = [store] + [ObjectStore.from_url(store.url) for _ in range(3)]
    # SeaweedFS makes the losers of a race wait on a per-key lock, about a second per
    # turn: 16 writers in 2 rounds keep this test to a few seconds.
    writers = 16
    for round_ in range(2):
        key = f"race/segment-{round_}.parquet"
        barrier = threading.Barrier(writers)
        payloads = [f"writer {i:02d} ".encode() * (2000 + i) for i in range(writers)]

        def create(
            i: int,
            key: str = key,
            barrier: threading.Barrier = barrier,
            payloads: list[bytes] = payloads,
        ) -> bool:
            barrier.wait()
            return stores[i % len(stores)].put_if_absent(key, payloads[i])

        with ThreadPoolExecutor(writers) as pool:
            won = list(pool.map(create, range(writers)))
        assert won.count(True) == 1, won
        assert store.get(key) == payloads[won.index(True)]


def test_list_pages_through_every_key(store: ObjectStore) -> None:
    keys = [f"vectors/seg-{i:04d}.parquet" for i in range(23)]
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(lambda k: store.put_if_absent(k, k.encode() * 3), keys))
    store.put("index/manifest.json", b"{}")
    requests: list[object] = []
    store._client.meta.events.register(
        "before-call.s3.ListObjectsV2", lambda **kw: requests.append(kw)
    )
    listed = list(store.list("vectors/", page_size=5))
    assert [(o.key, o.size) for o in listed] == [(k, 3 * len(k)) for k in keys]
    assert all(abs(o.modified - time.time()) < 600 for o in listed)
    assert len(requests) == 5  # 23 keys, 5 a page
    # Key order (S3 lists keys in UTF-8 binary order), relative to the prefix.
    assert [info.key for info in store.list()] == ["index/manifest.json", *keys]
    assert list(store.list("nothing-here/")) == []


def test_megabytes_round_trip_from_bytes_path_and_file(store: ObjectStore, tmp_path: Path) -> None:
    data = os.urandom(5 * 1024 * 1024 + 17)
    assert store.put_if_absent("blob/from-bytes", data)
    assert store.get("blob/from-bytes") == data

    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    assert store.put_if_absent("blob/from-path", path)
    assert store.get("blob/from-path") == data

    with open(path, "rb") as f:
        f.seek(1000)  # uploaded from the current position
        assert store.put_if_absent("blob/from-file", f)
    assert store.get("blob/from-file") == data[1000:]

    store.put("blob/from-memoryview", memoryview(data)[:1234])
    assert store.get("blob/from-memoryview") == data[:1234]

    store.delete("blob/from-bytes")
    store.delete("blob/from-bytes")  # deleting what is gone is no error
    assert not store.exists("blob/from-bytes")
    with pytest.raises(FileNotFoundError, match="blob/from-bytes"):
        store.get("blob/from-bytes")
    with pytest.raises(TypeError):
        store.put("blob/ambiguous", str(path))  # type: ignore[arg-type]


def test_uploads_carry_content_md5_and_no_chunked_checksum(store: ObjectStore) -> None:
    sent: list[dict[str, str]] = []

    def capture(request, **_: object) -> None:
        sent.append({k.lower(): str(v) for k, v in request.headers.items()})

    store._client.meta.events.register("before-send.s3.PutObject", capture)
    store.put_if_absent("checked", b"payload")
    (headers,) = sent
    assert headers["content-md5"]
    assert headers["if-none-match"] in ("*", "b'*'")
    assert "aws-chunked" not in headers.get("content-encoding", "")
    assert not any(name.startswith("x-amz-checksum") for name in headers)
    assert "x-amz-trailer" not in headers
    assert store.get("checked") == b"payload"

    # The server checks the digest: a damaged body is refused, not stored.
    def damage(request, **_: object) -> None:
        request.headers.replace_header("Content-MD5", "AAAAAAAAAAAAAAAAAAAAAA==")

    store._client.meta.events.register("before-sign.s3.PutObject", damage)
    with pytest.raises(OutputError, match="Content-MD5") as caught:
        store.put_if_absent("damaged", b"payload")
    _one_line(caught.value)
    store._client.meta.events.unregister("before-sign.s3.PutObject", damage)
    assert not store.exists("damaged")


def test_parquet_round_trip_through_the_stores_reads(store: ObjectStore, tmp_path: Path) -> None:
    dim = 8
    rows = 2000
    table = pa.table(
        {
            "topic": pa.array(["corpus"] * rows, pa.string()),
            "partition": pa.array([3] * rows, pa.int32()),
            "offset": pa.array(range(rows), pa.int64()),
            "key": pa.array([None] * rows, pa.binary()),
            "text": pa.array([f"text {i}" for i in range(rows)], pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(
                pa.array([float(i % 97) for i in range(rows * dim)], pa.float32()), dim
            ),
        }
    ).replace_schema_metadata({"model": "tiny", "dim": str(dim)})
    local = tmp_path / "corpus-3-0.parquet"
    pq.write_table(table, local)
    written = local.read_bytes()

    assert store.put_if_absent("vectors/corpus-3-0.parquet", local)
    assert store.put_if_absent("vectors/corpus-3-0.parquet", b"not parquet") is False

    assert store.get("vectors/corpus-3-0.parquet") == written  # byte-identical

    ranged = store.open_ranged("vectors/corpus-3-0.parquet")
    read = pq.read_table(ranged)  # pyarrow reads the footer, then the columns, by ranges
    assert read.equals(table)
    assert read.schema.metadata[b"model"] == b"tiny"
    only = pq.read_table(store.open_ranged("vectors/corpus-3-0.parquet"), columns=["offset"])
    assert only["offset"].to_pylist() == list(range(rows))
    with pytest.raises(FileNotFoundError):
        store.open_ranged("vectors/missing.parquet")


@pytest.mark.usefixtures("s3_url")  # the credentials, from the environment
def test_unreachable_endpoint_fails_fast_with_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    store = ObjectStore.from_url("s3://pipeline-test/x", endpoint=f"http://127.0.0.1:{closed_port}")
    started = time.monotonic()
    with pytest.raises(OutputError, match="unreachable") as caught:
        store.put_if_absent("a", b"1")
    assert time.monotonic() - started < 5
    assert f"127.0.0.1:{closed_port}" in _one_line(caught.value)
    assert caught.value.__cause__ is not None

    # A server that accepts connections but never answers: the read timeout applies.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        store = ObjectStore.from_url(
            "s3://pipeline-test/x",
            endpoint=f"http://127.0.0.1:{port}",
            read_timeout=0.5,
            max_attempts=2,
        )
        started = time.monotonic()
        with pytest.raises(OutputError, match="unreachable") as caught:
            store.get("a")
        assert time.monotonic() - started < 5
        _one_line(caught.value)


@pytest.mark.usefixtures("s3_url")
def test_missing_bucket_and_bad_credentials(s3_server: dict[str, str]) -> None:
    missing = ObjectStore.from_url("s3://no-such-bucket-for-pipeline/out")
    for attempt in (
        lambda: missing.put_if_absent("a", b"1"),
        lambda: missing.get("a"),
        lambda: missing.exists("a"),
        lambda: list(missing.list()),
        missing.check,
    ):
        with pytest.raises(OutputError, match="bucket 'no-such-bucket-for-pipeline' does not"):
            attempt()

    wrong = ObjectStore.from_url(
        "s3://pipeline-test/out",
        access_key=s3_server["AWS_ACCESS_KEY_ID"],
        secret_key="not-the-secret",
    )
    with pytest.raises(OutputError, match="access denied") as caught:
        wrong.put_if_absent("a", b"1")
    assert "AWS_SECRET_ACCESS_KEY" in _one_line(caught.value)


def test_configuration_from_url_and_environment(
    s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert S3Url.parse("s3://b") == S3Url("b", "")
    assert S3Url.parse("s3://b/a/b/") == S3Url("b", "a/b/")
    for bad in ("/data/out", "s3:/b/x", "s3://", "gs://b/x", "s3://b/a//c"):
        with pytest.raises(ConfigError):
            S3Url.parse(bad)
    assert is_object_store_url("s3://b/x") and not is_object_store_url("/data/out")
    for endpoint in ("ftp://host", "http://host:99999", "http://[::1"):
        with pytest.raises(ConfigError, match="invalid S3 endpoint"):
            ObjectStore.from_url("s3://b/x", endpoint=endpoint)

    # Endpoint and credentials from the standard variables alone.
    for name in ("PIPELINE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server["PIPELINE_S3_ENDPOINT"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server["AWS_SECRET_ACCESS_KEY"])
    store = ObjectStore.from_url(f"s3://{s3_server['PIPELINE_S3_BUCKET']}/env-{os.getpid()}/")
    assert store.endpoint == s3_server["PIPELINE_S3_ENDPOINT"]
    store.check()
    store.verify_conditional_put()
    try:
        store.put("k", io.BytesIO(b"from env"))
        assert store.get("k") == b"from env"
        assert [i.key for i in store.list()] == ["k"]  # the probe left nothing behind
    finally:
        store.delete("k")
