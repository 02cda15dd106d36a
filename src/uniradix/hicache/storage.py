"""L3: the `StorageBackend` interface. A flat store of key -> bytes that engine
instances share. Backends store and return opaque bytes; the object header (format,
namespace, key, checksum) is added and checked above them (`objects.py`), so a backend
never has to trust what it reads.

Errors: a backend that cannot reach its store raises `StorageUnavailable` from any
call (building one sends nothing: a start asks `probe()`, backends.open_backend); a
set that fails for one key (disk full, say) reports False for it and goes on.
Every failure is counted in `stats()` (set_failures, errors); the warnings about them
are rate-limited (`log_limit.LogLimiter`), so the counters, not the log, say how many.

Something under a key's name that is not a value this backend stored (a directory or a
FIFO in a file store, a list in Redis) is an unreadable entry: a miss, counted in
`unreadable` (the storage tier counts it as a storage error) and removed, so that the
next write of that key stores it again; it never blocks a read or that prefix. So is a
value larger than any its readers store (`expect_values_up_to`), found before it is read.

Every call is bounded in time: a store that does not answer raises
`StorageUnavailable` after the backend's timeout (redis: socket_timeout; mooncake:
op_timeout), never blocks for good. The storage tier calls backends only on its I/O
threads and never waits for them without a deadline, so even a backend that hangs
(a stuck network filesystem under the file backend) costs reuse, not the scheduler.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod

# \Z, not $: "$" also matches before a trailing newline, and "<hash>\n" is no key.
KEY_RE = re.compile(r"^[0-9a-f]{64}(\.[A-Za-z0-9_-]{1,32})?\Z")
#: a key that no page hash is (chained page keys are digests): what `probe` asks for
PROBE_KEY = "0" * 64 + ".probe"


class StorageUnavailable(RuntimeError):
    """The backend's store cannot be reached (down, refused, timed out)."""


def check_key(key: str) -> str:
    """Keys are a 64-hex-digit page hash, optionally with a component suffix."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ValueError(f"not a storage key: {key!r} (64 hex digits, optional .suffix)")
    return key


class StorageBackend(ABC):
    """What every L3 backend implements. Keys: see `check_key`. All batch calls keep
    the order of `keys`."""

    name = "abstract"

    #: the largest value the readers of this backend store (None: no bound; see
    #: expect_values_up_to)
    max_value_bytes: int | None = None
    #: optional (redis and mooncake have one): a number the backend bumps when its
    #: store may have lost what it held (it reconnected, or the store answered again
    #: after failing); the storage tier then believes nothing stored and reads the
    #: witness again. A backend without one relies on the writes' own re-checks.
    generation: int | None = None

    def expect_values_up_to(self, nbytes: int) -> None:
        """The readers of this backend store values of at most `nbytes` (several readers
        may share one backend: the bound is the largest any asked for). A value found
        larger was written by none of them (a file extended, a sparse file, a value
        someone else set): the built-in backends see a value's size before they read it
        and treat such a value as an unreadable entry (a miss, counted, removed) without
        reading more than the bound of it, so that no entry in the store, however large,
        costs a reader its memory."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"a value bound must be a positive number of bytes, got {nbytes!r}")
        self.max_value_bytes = max(self.max_value_bytes or 0, nbytes)

    @abstractmethod
    def batch_exists(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, are present (the leading run)."""

    def batch_contains(self, keys: list[str]) -> list[bool]:
        """Per key, in order, whether it is present (every key is answered, unlike
        batch_exists, which stops at the first absent one). Every key is checked before
        any I/O; a key whose presence cannot be told (a per-key error) is False and
        counted in errors. This default asks batch_exists once per key; backends
        override it with one round trip."""
        for k in keys:
            check_key(k)
        return [self.batch_exists([k]) == 1 for k in keys]

    @abstractmethod
    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        """The stored bytes per key, None where absent."""

    @abstractmethod
    def batch_set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        """Store each value under its key (replacing); True per key that was stored."""

    def set_if_absent(self, key: str, value: bytes) -> bool:
        """Store `value` under `key` only if nothing is there yet: False when nothing was
        stored (the key was present, or the set failed), True when it was stored or the
        backend cannot tell.
        Backends do it atomically where their store can (two engines racing: one wins);
        this default (a membership check, then a set) cannot, so callers that must know
        who won read the key back."""
        check_key(key)
        if self.batch_exists([key]) == 1:
            return False
        return self.batch_set([key], [value]) == [True]

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove one key; True if it was there."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every key this backend stored (its namespace of the store)."""

    def probe(self) -> None:
        """Reach the store once (StorageUnavailable when it cannot be reached), as a
        start-up asks before it serves (backends.open_backend). This default asks
        whether a key nobody writes is present: any call reaches the store; a backend
        may override it with a cheaper one (redis: PING)."""
        self.batch_exists([PROBE_KEY])

    def stats(self) -> dict:
        """Counters: at least gets, hits, sets, set_failures (sets not stored, for any
        reason), errors (calls or keys that failed: store unreachable, a bad reply), and
        where a backend can meet them, unreadable (entries under a key's name that were
        not a stored value; removed)."""
        return {}

    def close(self) -> None:
        """Release connections and threads; log the failures not yet reported."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
