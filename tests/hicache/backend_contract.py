"""The StorageBackend contract (test_backend_contract.py) runs on every backend kind
through a `Store`: how to make backends of that kind, how to reach its raw store, and
what the kind is known to do differently (zero-length values refused, no key prefix,
close() that does nothing). Also the helpers the backend tests share: storage keys,
bad keys, the check that a backend whose store is gone fails every call in time, and a
directory that turns read-only.

Kinds: "file" (a directory per test), "redis" (the session's redis-server, a prefix per
test), "mooncake" (the session's mooncake_master; the test's backend is the session's
client, which lends the memory objects are placed in, cleared after each test: closing
a client takes a second or two; other instances a test makes lend none).
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import subprocess
import time
from typing import ClassVar

import pytest

from uniradix.hicache.storage import StorageBackend, StorageUnavailable

KINDS = ("file", "redis", "mooncake")
BASE_COUNTERS = ("gets", "hits", "sets", "set_failures", "errors", "bytes_written", "bytes_read")
MOONCAKE_SIZES = {"global_segment_size": "64MB", "local_buffer_size": "16MB"}


class DictBackend(StorageBackend):
    """A user backend held in a dict, for the dynamic loader's tests."""

    name = "dict"

    def __init__(self, tag="x"):
        self.tag, self.d = tag, {}

    def batch_exists(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.d:
            n += 1
        return n

    def batch_get(self, keys):
        return [self.d.get(k) for k in keys]

    def batch_set(self, keys, values):
        self.d.update(zip(keys, values))
        return [True] * len(keys)

    def delete(self, key):
        return self.d.pop(key, None) is not None

    def clear(self):
        self.d.clear()


def key(i, suffix: str = "", ns: str = "") -> str:
    h = hashlib.sha256(f"{ns}/{i}".encode()).hexdigest()
    return h + (f".{suffix}" if suffix else "")


def keys(n, start=0, suffix="", ns="") -> list[str]:
    return [key(i, suffix, ns) for i in range(start, start + n)]


# A trailing newline: "$" in a pattern matches before it, so a key check must not use it.
BAD_KEYS = ["abc", key(1).upper(), key(1) + ".", key(1) + ".a b", key(1) + "." + "s" * 33,
            key(1)[:-1], 123, None, "../" + key(1), key(1) + "\n", key(1) + ".swa\n"]


def assert_unavailable(b: StorageBackend, where: str, bound_s: float) -> int:
    """Every call raises StorageUnavailable naming `where`, each within `bound_s`.
    Returns how many calls were made (each counts one error)."""
    calls = [lambda: b.batch_exists(keys(2)), lambda: b.batch_contains(keys(2)),
             lambda: b.batch_get(keys(2)), lambda: b.batch_set(keys(2), [b"a", b"b"]),
             lambda: b.delete(key(0)), b.clear]
    for call in calls:
        t = time.monotonic()
        with pytest.raises(StorageUnavailable, match=where):
            call()
        assert time.monotonic() - t < bound_s
    return len(calls)


@contextlib.contextmanager
def read_only_later(path: str):
    """Make the directory `path` and yield `freeze()`, which makes it refuse writes, as a
    store remounted read-only mid-run would. A normal user: chmod. Root ignores modes, so
    as root a tmpfs mounted there is remounted read-only (skipped where mounting is not
    allowed)."""
    os.makedirs(path)
    if os.geteuid() != 0:
        try:
            yield lambda: os.chmod(path, 0o555)
        finally:
            os.chmod(path, 0o755)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", path], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here to make read-only: {r.stderr.decode().strip()}")
    try:
        yield lambda: subprocess.run(["mount", "-o", "remount,ro", path], check=True)
    finally:
        subprocess.run(["umount", path], check=True)


class Store:
    """One backend kind under the contract. `backend()` is the test's backend,
    `make(prefix)` another one on the same store, `twin(b)` another instance over b's
    store and namespace; `finish()`, after each test, closes what was made."""

    kind = "abstract"
    empty_stored = True   # a zero-length value is stored (else: refused, False for it)
    closes = True         # after close(), every call raises StorageUnavailable
    tells_set_if_absent = True   # set_if_absent answers False when the key was there
    bounded_reads = True  # a value past max_value_bytes is not read past it (else: read whole, dropped)
    counters = BASE_COUNTERS + ("exists_calls", "deletes")   # all counted in stats()
    clear_prefix = ""     # a prefix with characters a pattern must escape
    lookalike = ""        # a prefix an unescaped pattern of it would match
    clear_n = 300         # keys to clear
    # test name -> why this kind fails it (the test is then a strict xfail)
    known_gaps: ClassVar[dict[str, str]] = {}

    _names = itertools.count()

    def __init__(self) -> None:
        self.made: list[StorageBackend] = []

    def new(self, prefix: str) -> StorageBackend:
        raise NotImplementedError

    def make(self, prefix: str | None = None) -> StorageBackend:
        b = self.new(prefix if prefix is not None else f"contract{next(self._names)}:")
        self.made.append(b)
        return b

    def backend(self) -> StorageBackend:
        return self.make()

    def twin(self, b: StorageBackend) -> StorageBackend:
        return self.make(b.prefix)

    def identity(self, b: StorageBackend) -> dict:
        """What stats() says about the backend itself, after a successful call."""
        raise NotImplementedError

    def finish(self) -> None:
        for b in self.made:
            b.close()
        self.made.clear()

    def close(self) -> None:
        self.finish()

    # the raw store, for objects other writers put there
    def raw_put(self, b, names: list[str], value: bytes) -> None:
        raise NotImplementedError

    def raw_get(self, b, names: list[str]) -> list:
        raise NotImplementedError

    def raw_remove(self, b, names: list[str]) -> None:
        raise NotImplementedError


class FileStore(Store):
    """A "prefix" is a directory below the test's root: its clear() removes the key-named
    files there and nothing else."""

    kind = "file"
    closes = False
    clear_prefix, lookalike = "c1/", "c1x"

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root

    def new(self, prefix):
        from uniradix.hicache.backends.file import FileBackend
        return FileBackend(os.path.join(self.root, prefix.rstrip(":")))

    def twin(self, b):
        self.made.append(type(b)(b.path))
        return self.made[-1]

    def identity(self, b):
        return {"backend": "file", "path": b.path}

    def raw_put(self, b, names, value):
        for name in names:
            with open(os.path.join(self.root, name), "wb") as fh:
                fh.write(value)

    def raw_get(self, b, names):
        out = []
        for name in names:
            with open(os.path.join(self.root, name), "rb") as fh:
                out.append(fh.read())
        return out

    def raw_remove(self, b, names):
        for name in names:
            os.unlink(os.path.join(self.root, name))


class RedisStore(Store):
    kind = "redis"
    clear_prefix, lookalike, clear_n = "c[1]*:", "c1xyz:", 2500  # > one SCAN step, one DEL
    _raw = None

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url

    def new(self, prefix):
        from uniradix.hicache.backends.redis import RedisBackend
        return RedisBackend(self.url, prefix=prefix)

    def identity(self, b):
        return {"backend": "redis", "url": self.url, "prefix": b.prefix}

    def raw(self):
        if self._raw is None:
            import redis
            self._raw = redis.Redis.from_url(self.url)
        return self._raw

    def raw_put(self, b, names, value):
        assert self.raw().mset(dict.fromkeys(names, value))

    def raw_get(self, b, names):
        return self.raw().mget(names)

    def raw_remove(self, b, names):
        assert self.raw().delete(*names) == len(names)

    def close(self):
        super().close()
        if self._raw is not None:
            self._raw.close()


class MooncakeStore(Store):
    kind = "mooncake"
    empty_stored = False   # Mooncake holds no zero-length object (L3 objects never are)
    tells_set_if_absent = False   # its put keeps the old value but answers success
    bounded_reads = False  # a get brings the whole value (local_buffer_size bounds it)
    clear_prefix, lookalike = "c1.", "c1x"

    def __init__(self, address: str, shared: StorageBackend) -> None:
        super().__init__()
        self.address, self.shared = address, shared

    def new(self, prefix):
        # Lends no memory (objects go to the shared client's): closes in 1 s, not 2.
        from uniradix.hicache.backends.mooncake import MooncakeBackend
        return MooncakeBackend({"master": self.address, "prefix": prefix, **MOONCAKE_SIZES,
                                "global_segment_size": 0})

    def backend(self):
        return self.shared

    def finish(self):
        super().finish()
        self.shared.clear()

    def identity(self, b):
        return {"backend": "mooncake", "master": self.address, "prefix": b.prefix,
                "connected": True, "connects": 1}

    def raw_put(self, b, names, value):
        assert b.client._store.upsert_batch(names, [value] * len(names)) == 0

    def raw_get(self, b, names):
        return [b.client._store.get(n) for n in names]

    def raw_remove(self, b, names):
        assert b.client._store.batch_remove(names, True) == [0] * len(names)


def open_store(kind: str, request) -> Store:
    """The Store for `kind`, on the session's servers (fixtures in conftest.py)."""
    if kind == "file":
        return FileStore(str(request.getfixturevalue("tmp_path_factory").mktemp("contract")))
    if kind == "redis":
        pytest.importorskip("redis", reason="pip install redis (in the test extra)")
        return RedisStore(request.getfixturevalue("redis_srv").url)
    if kind == "mooncake":
        return MooncakeStore(request.getfixturevalue("mooncake_srv").address,
                             request.getfixturevalue("mooncake_shared"))
    raise ValueError(f"no contract store for {kind!r}")
