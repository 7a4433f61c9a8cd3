"""The object store's byte streams: a file-like reader of ranged GETs (what pyarrow
reads a footer or a column through), and upload bodies that can be sent again."""

from __future__ import annotations

import base64
import hashlib
import io
import os
from pathlib import Path
from typing import IO, Any, Protocol

from pipeline.core.errors import OutputError


class RangeReader(Protocol):
    """What a RangedObject reads through (sinks.objectstore.ObjectStore)."""

    def get_range(self, key: str, start: int, end: int | None = None) -> tuple[bytes, int]: ...


# One PUT carries at most this much (S3's limit); bodies are hashed a chunk at a time.
_MAX_SINGLE_PUT = 5 * 1024**3
_CHUNK = 1024 * 1024
# What a PUT takes: bytes, a path, or a seekable binary file.
Data = bytes | bytearray | memoryview | os.PathLike[str] | IO[bytes]


class RangedObject(io.RawIOBase):
    """See ObjectStore.open_ranged; reads past the fetched tail are ranged GETs."""

    def __init__(self, store: RangeReader, key: str, tail: int) -> None:
        super().__init__()
        self._store = store
        self._key = key
        data, self._size = store.get_range(key, -tail)
        self._tail_start = self._size - len(data)
        self._tail = data
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def read(self, size: int = -1) -> bytes:
        start = self._position
        end = self._size if size is None or size < 0 else min(self._size, start + size)
        if start >= end:
            return b""
        if start >= self._tail_start:
            data = self._tail[start - self._tail_start : end - self._tail_start]
        else:
            data, _ = self._store.get_range(self._key, start, end - 1)
        self._position = start + len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def size(self) -> int:
        return self._size


class Body:
    """A PUT's body: its bytes or file, size and Content-MD5, from bytes, a path or a
    seekable binary file (from its current position); `rewind()` before each attempt."""

    def __init__(self, data: Data) -> None:
        self._data = data
        self._owned: IO[bytes] | None = None
        self._bytes: bytes | None = None
        self._stream: IO[bytes] | None = None
        self._start = 0
        self.size = 0
        self.md5 = ""

    def __enter__(self) -> Body:
        data = self._data
        if isinstance(data, (bytes, bytearray, memoryview)):
            self._bytes = data if isinstance(data, bytes) else bytes(data)
            self.size = len(self._bytes)
            self.md5 = base64.b64encode(hashlib.md5(self._bytes).digest()).decode()
            return self
        if isinstance(data, str):
            raise TypeError("pass bytes, a pathlib.Path or a binary file, not a str")
        if isinstance(data, os.PathLike):
            self._owned = self._stream = open(Path(data), "rb")  # closed in __exit__
        elif hasattr(data, "read") and hasattr(data, "seek"):
            self._stream = data
        else:
            raise TypeError(f"cannot upload a {type(data).__name__}")
        stream = self._stream
        self._start = stream.tell()
        digest = hashlib.md5()
        while chunk := stream.read(_CHUNK):
            if isinstance(chunk, str):
                raise TypeError("the file must be opened in binary mode")
            digest.update(chunk)
        self.size = stream.tell() - self._start
        if self.size > _MAX_SINGLE_PUT:
            raise OutputError(f"an object of {self.size} bytes is over the 5 GiB of one S3 PUT")
        self.md5 = base64.b64encode(digest.digest()).decode()
        return self

    def rewind(self) -> bytes | IO[bytes]:
        """The body for one attempt (a file is sought back to where it started)."""
        if self._bytes is not None:
            return self._bytes
        assert self._stream is not None
        self._stream.seek(self._start)
        return self._stream

    def __exit__(self, *exc_info: object) -> None:
        if self._owned is not None:
            self._owned.close()
