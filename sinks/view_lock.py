"""Appliers of the current view take turns (sinks.view): an exclusive lock file
beside the table on a local output; a lease on an object store.

The lease: objects `view-lease/<epoch>` under the output, each created with a
create-if-absent PUT (sinks.objectstore) and holding its owner and expiry. The
holder is the creator of the newest epoch while it has not expired; a contender
takes the next epoch once it has, and exactly one contender's create wins. The
holder renews (a new epoch of its own) as it applies, and checks its own clock
before each commit: a worker stalled past its lease (SIGSTOP) wakes to find it
expired and commits nothing. Stopping, it writes a released epoch, so that another
worker takes over at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.core.errors import OutputError
from sinks.writers import WRITER

LEASE_PREFIX = "view-lease/"
LEASE_S = 30.0
_KEEP_EPOCHS = 8  # older lease objects are deleted by the holder


class LocalLock:
    """An exclusive lock on a file (`flock`): appliers on one machine wait their turn."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def held(self, wait_s: float = 0.0) -> Iterator[bool]:
        try:
            fh = open(self.path, "a+b")  # noqa: SIM115 - held for the block
        except OSError as exc:
            raise OutputError(f"cannot lock {self.path} for the view: {exc}") from exc
        with fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield True
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def valid(self) -> bool:
        return True

    def renew(self) -> bool:
        return True

    def release(self) -> None:
        """Nothing outlives the block."""


class StoreLease:
    """The view's lease on an object store (see the module's doc)."""

    def __init__(self, store: Any, lease_s: float = LEASE_S) -> None:
        self.store = store
        self.lease_s = lease_s
        self._epoch: int | None = None  # the epoch this process holds
        self._until = 0.0  # monotonic: past it, this process holds nothing

    @contextlib.contextmanager
    def held(self, wait_s: float = 0.0) -> Iterator[bool]:
        """Yields whether this process holds the lease (another worker applies if not),
        waiting up to `wait_s` for it."""
        deadline = time.monotonic() + wait_s
        held = self._acquire()
        while not held and time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            held = self._acquire()
        yield held

    def renew(self) -> bool:
        """Keeps the lease for another term if this process holds it; whether it does."""
        return self.valid() and self._acquire()

    def valid(self) -> bool:
        """Whether the lease is still this process's, by its own clock, with a margin of a
        sixth of the term (5 s of the default) for the clocks of other holders."""
        margin = self.lease_s / 6
        return self._epoch is not None and time.monotonic() < self._until - margin

    def release(self) -> None:
        if self._epoch is not None and self.valid():
            self._create(self._epoch + 1, expires=0.0)
        self._epoch = None

    def _acquire(self) -> bool:
        newest = self._newest()
        if newest is None:
            return self._create(0, time.time() + self.lease_s)
        epoch, owner, expires = newest
        mine = owner == WRITER and epoch == self._epoch and self.valid()
        if mine and self._until - time.monotonic() > self.lease_s / 2:
            return True
        if mine or time.time() > expires:
            return self._create(epoch + 1, time.time() + self.lease_s)
        self._epoch = None
        return False

    def _newest(self) -> tuple[int, str, float] | None:
        epochs = [
            int(o.key[len(LEASE_PREFIX) :])
            for o in self.store.list(LEASE_PREFIX)
            if o.key[len(LEASE_PREFIX) :].isdigit()
        ]
        if not epochs:
            return None
        epoch = max(epochs)
        try:
            body = json.loads(self.store.get(_key(epoch)))
        except FileNotFoundError:  # removed by its holder's clean-up meanwhile
            return epoch, "", 0.0
        for old in sorted(epochs)[:-_KEEP_EPOCHS]:
            if self._epoch is not None:
                self.store.delete(_key(old))
        return epoch, str(body.get("owner", "")), float(body.get("expires", 0.0))

    def _create(self, epoch: int, expires: float) -> bool:
        started = time.monotonic()
        body = json.dumps({"owner": WRITER, "expires": expires}).encode()
        if not self.store.put_if_absent(_key(epoch), body):
            self._epoch = None
            return False
        self._epoch, self._until = epoch, started + (expires - time.time() if expires else 0.0)
        return bool(expires)


def _key(epoch: int) -> str:
    return f"{LEASE_PREFIX}{epoch:012d}"


class LeaseLost(Exception):
    """The view's lease expired before a commit: the apply is dropped (and redone)."""


def commit(dataset: Any, transaction: Any, lock: LocalLock | StoreLease) -> None:
    """Commits `transaction` on the Lance `dataset` it was built from, if this process
    still holds the view (a worker stalled past its lease: another may be applying);
    a commit that landed meanwhile is a conflict, not overwritten."""
    import lance

    if not lock.valid():
        raise LeaseLost
    lance.LanceDataset.commit(dataset, transaction, read_version=dataset.version)
