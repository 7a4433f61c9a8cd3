"""What the pipeline needs from an S3-compatible object store, and nothing more.

`ObjectStore.from_url("s3://bucket/prefix")` gives a client rooted at `prefix`: every
key below is relative to it, as paths are relative to a local `--output` directory.

- `put_if_absent(key, data)`: create-if-absent, a PUT with `If-None-Match: *`. The
  object-store twin of the hard link that publishes a local segment: of writers
  racing for one key exactly one gets True; the others get False and the object
  stays the winner's. AWS S3 answers an existing key with 412 PreconditionFailed,
  and a write that raced another conditional operation on the key with 409
  ConditionalRequestConflict, which says nothing about who won: that one is retried
  until the store answers 200 or 412. SeaweedFS and MinIO answer 412.
- `put`, `get`, `exists`, `delete`, `list(prefix, page_size=...)`.
- `get_range(key, start, end)` and `open_ranged(key)`: a file-like reader that
  fetches ranges, for pyarrow to read a footer or a column without the rest.
- `check()` (bucket reachable and listable) and `verify_conditional_put()` (the
  store really refuses a second create: one that ignores `If-None-Match` would
  let two writers both "win").

Configuration: the endpoint comes from the `endpoint` argument, else
`PIPELINE_S3_ENDPOINT`, `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, else AWS itself;
credentials and region from the arguments or the standard AWS chain
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_PROFILE`,
`AWS_REGION`, ...). `scripts/dev-s3.sh env` prints them for the local server.

Uploads send no flexible checksum unless an operation requires one
(`request_checksum_calculation="when_required"`): by default botocore frames
bodies sent over HTTPS as `aws-chunked` with a trailing checksum, which some
S3-compatible servers store as is. Integrity comes from a `Content-MD5` header
instead, which every S3 implementation checks (400 BadDigest on a mismatch).

Errors: a store that cannot be reached, refuses the credentials, or lacks the
bucket raises `OutputError` with one actionable line, chained to botocore's error.
A missing key is `FileNotFoundError` (as for a local file).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from pipeline.core.errors import ConfigError, OutputError
from pipeline.core.retry import Backoff, retry
from sinks.object_io import Body, Data, RangedObject

ENDPOINT_ENV_VARS = ("PIPELINE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
DEFAULT_REGION = "us-east-1"

# Bytes, or a file: a path (pathlib.Path or any os.PathLike; a plain str is refused
# as ambiguous) or a binary file object, read from its current position.

# A single PUT carries at most 5 GiB on AWS; segments are far smaller.
# Between tries of a create that raced another conditional write (409): 50 ms doubling
# to 2 s, each stretched by up to as much again at random.
_CONFLICT_BACKOFF = Backoff(0.05, 2.0, max_s=2.0, jitter=1.0)
_ACCESS_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "AccountProblem",
        "403",
    }
)


class ObjectInfo(NamedTuple):
    """One listed object: its key (relative to the store's prefix), size in bytes and
    time of last modification (seconds since the epoch, as the store says)."""

    key: str
    size: int
    modified: float = 0.0


@dataclass(frozen=True)
class S3Url:
    """`s3://bucket/prefix`, split; `prefix` is empty or ends with one `/`."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> S3Url:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ConfigError(f"not an object-store URL: {url!r} (expected s3://bucket/prefix)")
        if parts.query or parts.fragment:
            raise ConfigError(f"object-store URL {url!r} must not have a query or fragment")
        prefix = parts.path.strip("/")
        if "//" in prefix:
            raise ConfigError(f"object-store URL {url!r} has an empty path segment")
        return cls(parts.netloc, f"{prefix}/" if prefix else "")

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def is_object_store_url(output: str | os.PathLike[str]) -> bool:
    """Whether an `--output` value names an object store rather than a directory."""
    return isinstance(output, str) and output.startswith("s3://")


def endpoint_from_env() -> str | None:
    for name in ENDPOINT_ENV_VARS:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def _endpoint_url(endpoint: str | None) -> str | None:
    """`http(s)://host[:port][/path]`, without a trailing slash; a bare host is https."""
    endpoint = (endpoint or "").strip().rstrip("/")
    if not endpoint:
        return None
    if "://" not in endpoint:
        endpoint = f"https://{endpoint}"
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError as exc:
        raise ConfigError(f"invalid S3 endpoint {endpoint!r}: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"invalid S3 endpoint {endpoint!r}: expected http(s)://host[:port]")
    return endpoint


def _boto3() -> Any:
    try:
        import boto3
    except ImportError as exc:
        raise ConfigError(
            "s3:// outputs need boto3: install it with pip install 'embedding-pipeline[s3]'"
        ) from exc
    return boto3


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


class ObjectStore:
    """A bucket and a key prefix on an S3-compatible store; thread-safe (one botocore
    client, shared by threads, as botocore allows)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_attempts: int = 3,
        max_pool_connections: int = 32,
        conflict_retries: int = 8,
    ) -> None:
        boto3 = _boto3()
        from botocore.config import Config

        prefix = prefix.strip("/")
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.endpoint = _endpoint_url(endpoint or endpoint_from_env())
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_attempts = max_attempts
        self.conflict_retries = conflict_retries
        try:
            self._session = boto3.session.Session(
                aws_access_key_id=access_key,
                aws_secret_access_key=secret_key,
                aws_session_token=session_token,
                region_name=region,
            )
            session_region = self._session.region_name
        except _botocore_errors() as exc:  # e.g. AWS_PROFILE names no profile
            raise ConfigError(f"cannot configure the S3 client: {_one_line(exc)}") from exc
        self.region = region or os.environ.get("AWS_REGION") or session_region or DEFAULT_REGION
        config = Config(
            region_name=self.region,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"mode": "standard", "max_attempts": max_attempts},
            max_pool_connections=max_pool_connections,
            # No aws-chunked bodies with trailing checksums (see the module's doc).
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # S3-compatible servers answer path-style requests (bucket in the path)
            # whatever their DNS; AWS itself takes either.
            s3={"addressing_style": "path" if self.endpoint else "auto"},
        )
        try:
            self._client = self._session.client("s3", endpoint_url=self.endpoint, config=config)
        except ValueError as exc:  # botocore: an endpoint URL it cannot use
            raise ConfigError(f"invalid S3 endpoint {self.endpoint!r}: {_one_line(exc)}") from exc
        self._bucket_checked = False
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> ObjectStore:
        """`s3://bucket/prefix` (prefix optional); kwargs as for the constructor."""
        parsed = S3Url.parse(url)
        return cls(parsed.bucket, parsed.prefix, **kwargs)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r}, endpoint={self.endpoint!r})"

    def __str__(self) -> str:
        return self.url.rstrip("/")

    def __deepcopy__(self, memo: dict[int, Any]) -> ObjectStore:
        # Shared, not copied (a configuration's asdict() deep-copies its values):
        # the client is thread-safe and the store holds nothing a copy should not.
        return self

    def connection_options(self) -> dict[str, str]:
        """The endpoint, region and credentials, as object_store's (Rust) S3 options:
        for libraries that open the bucket themselves (Lance, for the current view)."""
        options = {"aws_region": self.region}
        if self.endpoint:
            options["aws_endpoint"] = self.endpoint
            options["allow_http"] = str(self.endpoint.startswith("http://")).lower()
        credentials = self._session.get_credentials()
        if credentials is not None:
            frozen = credentials.get_frozen_credentials()
            options["aws_access_key_id"] = frozen.access_key
            options["aws_secret_access_key"] = frozen.secret_key
            if frozen.token:
                options["aws_session_token"] = frozen.token
        return options

    def full_key(self, key: str) -> str:
        """The bucket key for `key` (relative to the prefix)."""
        if not key or key.startswith("/") or key.endswith("/"):
            raise ValueError(f"object key must be a non-empty relative name, not {key!r}")
        return self.prefix + key

    # -- writes ---------------------------------------------------------------

    def put_if_absent(self, key: str, data: Data) -> bool:
        """Creates `key` with `data` unless it exists: True when this call created it,
        False when the key already existed (its content is left as it was)."""
        from botocore.exceptions import ClientError

        full = self.full_key(key)

        def create(body: Body) -> bool:
            try:
                self._put_object(full, body, IfNoneMatch="*")
                return True
            except ClientError as exc:
                status, code = _status_and_code(exc)
                if status == 412 or code == "PreconditionFailed":
                    return False
                if status == 501 or code == "NotImplemented":
                    raise OutputError(
                        f"the object store at {self._where()} does not support "
                        f"conditional writes (If-None-Match), which exactly-once "
                        f"output needs"
                    ) from exc
                raise

        with Body(data) as body, self._translated("create", full):
            # A write that raced another conditional one on the key has no answer yet.
            return retry(
                lambda: create(body),
                on=ClientError,
                when=_is_conflict,
                attempts=self.conflict_retries + 1,
                pause=_CONFLICT_BACKOFF,
            )

    def put(self, key: str, data: Data) -> None:
        """Writes `key` (replacing any object there)."""
        full = self.full_key(key)
        with self._translated("write", full), Body(data) as body:
            self._put_object(full, body)

    def _put_object(self, full: str, body: Body, **conditions: str) -> None:
        """One PUT of `body` (from its start, with its MD5, which the store checks)."""
        self._client.put_object(
            Bucket=self.bucket,
            Key=full,
            Body=body.rewind(),
            ContentLength=body.size,
            ContentMD5=body.md5,
            **conditions,
        )

    def delete(self, key: str) -> None:
        """Deletes `key`; no error when it does not exist."""
        full = self.full_key(key)
        with self._translated("delete", full):
            self._client.delete_object(Bucket=self.bucket, Key=full)

    # -- reads ----------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The whole object; FileNotFoundError when there is none."""
        full = self.full_key(key)
        with self._translated("read", full, missing=True):
            response = self._client.get_object(Bucket=self.bucket, Key=full)
            with response["Body"] as stream:
                return stream.read()

    def get_range(self, key: str, start: int, end: int | None = None) -> tuple[bytes, int]:
        """Bytes `start..end` (inclusive) of the object, or its last `-start` bytes when
        `start` is negative; with the object's whole size. FileNotFoundError when there
        is none. A store error is OutputError, never an OSError: a reader can tell a
        damaged object from one it could not fetch."""
        from botocore.exceptions import ClientError

        full = self.full_key(key)
        wanted = f"bytes={start}" if start < 0 else f"bytes={start}-{'' if end is None else end}"
        with self._translated("read", full, missing=True):
            try:
                response = self._client.get_object(Bucket=self.bucket, Key=full, Range=wanted)
            except ClientError as exc:
                if _is_range_not_satisfiable(exc):  # an empty object
                    return b"", 0
                raise
            with response["Body"] as stream:
                data = stream.read()
        total = response.get("ContentRange", "").rpartition("/")[2]
        return data, int(total) if total.isdigit() else len(data)

    def open_ranged(self, key: str, tail: int = 64 * 1024) -> RangedObject:
        """A read-only, seekable file on the object that fetches its last `tail` bytes at
        once and any other range on demand: a Parquet footer costs one request."""
        return RangedObject(self, key, tail)

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except FileNotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        """The object's size in bytes; FileNotFoundError when there is none."""
        full = self.full_key(key)
        try:
            with self._translated("look up", full, missing=True):
                head = self._client.head_object(Bucket=self.bucket, Key=full)
        except FileNotFoundError:
            # A HEAD has no body, so a missing bucket is a bare 404 as well.
            self._ensure_bucket()
            raise
        return int(head["ContentLength"])

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectInfo]:
        """Objects whose key (relative to the store's prefix) starts with `prefix`, in
        key order, fetched `page_size` keys per request."""
        if not 1 <= page_size <= 1000:
            raise ValueError(f"page_size must be 1..1000, not {page_size}")
        full_prefix = self.prefix + prefix
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Prefix": full_prefix,
            "MaxKeys": page_size,
        }
        while True:
            with self._translated("list", full_prefix):
                page = self._client.list_objects_v2(**kwargs)
            for item in page.get("Contents", ()):
                modified = item.get("LastModified")
                yield ObjectInfo(
                    item["Key"][len(self.prefix) :],
                    int(item["Size"]),
                    modified.timestamp() if modified is not None else 0.0,
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            kwargs["ContinuationToken"] = token

    # -- checks ---------------------------------------------------------------

    def check(self) -> None:
        """Raises OutputError unless the store answers, accepts the credentials and
        holds the bucket (one small list request)."""
        with self._translated("list", self.prefix):
            self._client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
        self._bucket_checked = True

    def verify_conditional_put(self) -> None:
        """Raises OutputError unless a second create of one key is refused: a store
        that ignores `If-None-Match` would let two writers of a segment both win."""
        key = f"_probe/conditional-put-{os.getpid()}-{random.getrandbits(64):016x}"
        try:
            first = self.put_if_absent(key, b"1")
            second = self.put_if_absent(key, b"2")
            kept = self.get(key) if first and not second else b""
        finally:
            self.delete(key)
        if not (first and not second and kept == b"1"):
            raise OutputError(
                f"the object store at {self._where()} ignores If-None-Match on PUT (a second "
                f"create of one key succeeded): it cannot hold exactly-once output"
            )

    def _ensure_bucket(self) -> None:
        if not self._bucket_checked:
            self.check()

    # -- pyarrow --------------------------------------------------------------

    def _where(self) -> str:
        return self.endpoint or f"AWS S3 ({self.region})"

    def _s3(self, full_key: str) -> str:
        return f"s3://{self.bucket}/{full_key}"

    @contextlib.contextmanager
    def _translated(self, action: str, full_key: str, missing: bool = False) -> Iterator[None]:
        """A botocore failure as one OutputError line (`_error`); with `missing`, a key
        that is not there as FileNotFoundError, as for a local file. Nothing else is
        caught: any other exception is a bug and keeps its traceback."""
        try:
            yield
        except _botocore_errors() as exc:
            if missing and _is_not_found(exc):
                where = f"no object {self._s3(full_key)} at {self._where()}"
                raise FileNotFoundError(where) from exc
            raise self._error(exc, action, full_key) from exc

    def _error(self, exc: BaseException, action: str, full_key: str) -> OutputError:
        """One actionable line for a botocore failure."""
        from botocore.exceptions import (
            ClientError,
            HTTPClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )
        from botocore.exceptions import ConnectionError as BotoConnectionError

        target = self._s3(full_key)
        where = self._where()
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return OutputError(
                f"no credentials for the object store at {where}: set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            )
        if isinstance(exc, (BotoConnectionError, HTTPClientError)):
            return OutputError(
                f"the object store at {where} is unreachable ({action} {target}: "
                f"{_one_line(exc)}); check PIPELINE_S3_ENDPOINT and that the server is up"
            )
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            status, code = _status_and_code(exc)
            message = _one_line(error.get("Message", "")) or f"HTTP {status}"
            if code == "NoSuchBucket":
                return OutputError(
                    f"bucket {self.bucket!r} does not exist at {where}: create it or fix "
                    f"the output URL ({self.url})"
                )
            if code in _ACCESS_CODES or status == 403:
                return OutputError(
                    f"access denied to {target} at {where} ({code or status}): check "
                    f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's policy"
                )
            if code == "BadDigest":
                return OutputError(
                    f"the object store at {where} received {target} damaged (Content-MD5 "
                    f"mismatch); retry, and check the network path if it recurs"
                )
            return OutputError(
                f"cannot {action} {target} at {where}: {code or status} {message}".rstrip()
            )
        return OutputError(f"cannot {action} {target} at {where}: {_one_line(exc)}")


def _botocore_errors() -> tuple[type[Exception], ...]:
    """What botocore raises for a failed request (boto3 is an optional extra, so
    imported when a store is made)."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


def _status_and_code(exc: Any) -> tuple[int | None, str]:
    """A ClientError's HTTP status and error code."""
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status, str(exc.response.get("Error", {}).get("Code", ""))


def _is_conflict(exc: Exception) -> bool:
    """A conditional write that raced another conditional operation on the key (409)."""
    status, code = _status_and_code(exc)
    return status == 409 or code == "ConditionalRequestConflict"


def _is_range_not_satisfiable(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError

    if not isinstance(exc, ClientError):
        return False
    return str(exc.response.get("Error", {}).get("Code", "")) in ("InvalidRange", "416")


def _is_not_found(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError

    if not isinstance(exc, ClientError):
        return False
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code in ("NoSuchKey", "404", "NotFound")
