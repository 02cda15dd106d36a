"""The Redis backend: one Redis string per key, named `prefix + key`, holding the raw
object bytes. Works with any server that speaks the Redis protocol (redis-server,
Valkey). Engines that point at the same server and prefix share their L3.

Batch calls go through one pipeline each (one round trip; batch_contains: one TOUCH
per key, in one pipeline). A server that cannot be reached or does not answer within
`socket_timeout` raises `StorageUnavailable` naming the URL; a per-key error reply to a
SET (OOM under `maxmemory` with `noeviction`, a read-only replica) stores nothing for
that key and reports False for it, counted in set_failures and warned about once (then
in summaries, see log_limit.py). A value of another type under a key's name (GET
answers WRONGTYPE), or one larger than any its readers store (`max_value_bytes`: only
that much of it is read), is an unreadable entry: a miss, counted (unreadable, errors)
and deleted, so the next write of that key stores it again.

L3 eviction belongs to the server: give it a `maxmemory` and an eviction policy
(`allkeys-lru`, say) if it should drop old objects rather than refuse new ones.

The `redis` package (redis-py) is imported only when a backend is built:
`pip install redis` (or the `storage` extra) where this backend is used.
"""
from __future__ import annotations

import logging
import math
import re
import threading
import weakref
from ...redact import mask_known, redact, url_secrets
from ..log_limit import LogLimiter
from ..storage import KEY_RE, StorageBackend, StorageUnavailable, check_key

log = logging.getLogger("uniradix.hicache")

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "uniradix:"
ACCEPTED = ("url", "prefix", "socket_timeout")
SCAN_COUNT = 1000    # keys per SCAN step in clear()
DEL_BATCH = 1000     # keys per DEL in clear()


def _redis_module():
    try:
        import redis  # the redis-py package (absolute import: not this module)
    except ImportError as e:
        raise ImportError("the redis storage backend needs the redis Python package: "
                          "pip install redis  (or pip install 'uniradix[storage]')") from e
    return redis


def redact_url(url: str) -> str:
    """The URL with its secrets masked (***), for messages and stats: the password
    with or without a user, and `?password=` and the other secret query keys
    (uniradix.redact, the one rule every printed setting follows)."""
    return redact(url)


class RedisBackend(StorageBackend):
    """`url`: redis://[[user]:password@]host:port/db, rediss:// for TLS, or
    unix:///path.sock?db=N. `prefix`: prepended to every key; `clear()` removes only
    this prefix's keys, so engines can use separate prefixes on one server.
    `socket_timeout`: seconds to wait for a connect or a reply before the call raises
    `StorageUnavailable`."""

    name = "redis"

    def __init__(self, url: str = DEFAULT_URL, prefix: str = DEFAULT_PREFIX,
                 socket_timeout: float = 2.0, **unknown) -> None:
        if unknown:
            raise ValueError(f"redis backend: unknown setting(s) {sorted(unknown)}; "
                             f"it takes {', '.join(ACCEPTED)}")
        if not isinstance(url, str) or not url:
            raise ValueError(f"redis backend: url must be a non-empty string, got {url!r}")
        if not isinstance(prefix, str):
            raise ValueError(f"redis backend: prefix must be a string, got {prefix!r}")
        if (isinstance(socket_timeout, bool) or not isinstance(socket_timeout, (int, float))
                or not 0 < socket_timeout < math.inf):
            raise ValueError(f"redis backend: socket_timeout must be a positive, finite number "
                             f"of seconds, got {socket_timeout!r}")
        redis = _redis_module()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.safe_url = redact_url(url)
        self._secrets = url_secrets(url)  # masked in redis-py's own messages too (it may quote a piece)
        self.prefix = prefix
        self.socket_timeout = float(socket_timeout)
        self._redis = redis
        self._lock = threading.Lock()
        self._closed = False
        self.counters = dict.fromkeys(("gets", "hits", "sets", "set_failures", "errors",
                                       "bytes_written", "bytes_read", "exists_calls", "deletes",
                                       "bad_replies", "unreadable"), 0)
        self.failure_log = LogLimiter(log, f"redis backend at {self.safe_url}")
        # bumped when a connection that was open connects again (the server restarted or
        # dropped it: what it held may be gone); the storage tier then believes nothing
        # stored and checks the witness again
        self.generation = 0
        self._seen = weakref.WeakSet()
        try:
            # One retry, only for a dropped connection (a pooled socket the server closed,
            # after a restart say); a timeout is never retried, so a call waits at most
            # about socket_timeout per round trip.
            self.pool = redis.ConnectionPool.from_url(
                url, socket_timeout=self.socket_timeout, socket_connect_timeout=self.socket_timeout,
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
                redis_connect_func=self._connected)
            # redis-py takes every query key of the URL as a connection setting and refuses
            # one it does not know (?PASSWORD=, its names are lower case) only when it first
            # connects, a TypeError: a connection object, made without connecting, says so now
            self.pool.connection_class(**self.pool.connection_kwargs)
        except TypeError as e:
            unknown = re.search(r"unexpected keyword argument '([^']*)'", str(e))
            what = f"unknown query option {unknown.group(1)!r} (redis-py's are lower case: password, db, " \
                   f"username, ...)" if unknown else self._masked(e)
            raise ValueError(f"redis backend: bad url {self.safe_url!r}: {what}") from None
        except ValueError as e:
            raise ValueError(f"redis backend: bad url {self.safe_url!r}: {self._masked(e)}") from None
        # Nothing is sent yet: whether the server answers at start-up is the start-up's
        # question (probe, asked by backends.open_backend); a server that is not there
        # makes every call raise StorageUnavailable until it answers.
        self.client = redis.Redis(connection_pool=self.pool)

    def probe(self) -> None:
        """One PING (StorageUnavailable naming the URL when the server does not answer)."""
        self._call(self.client.ping)

    # ------------------------------------------------------------------ plumbing
    def _connected(self, conn) -> None:
        """redis-py's hook once a connection's socket is up: finish the handshake, and
        count a reconnect (a new connection for a busier pool is none)."""
        conn.on_connect()
        with self._lock:
            if conn in self._seen:
                self.generation += 1
            else:
                self._seen.add(conn)

    def _k(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self.counters[k] += v

    def _call(self, fn, *args):
        """Run one client or pipeline call; no reply in time, or no connection, is
        StorageUnavailable (counted)."""
        if self._closed:
            raise StorageUnavailable(f"redis backend at {self.safe_url} is closed")
        exc = self._redis.exceptions
        try:
            return fn(*args)
        except (exc.ConnectionError, exc.TimeoutError, OSError) as e:
            self._count(errors=1)
            what = "timed out" if isinstance(e, exc.TimeoutError) else "unreachable"
            raise StorageUnavailable(f"redis backend: {self.safe_url} {what}: {self._masked(e)}") from e
        except exc.RedisError as e:  # a protocol error or a refused command: not usable
            self._count(errors=1)
            raise StorageUnavailable(f"redis backend: {self.safe_url} failed: "
                                     f"{type(e).__name__}: {self._masked(e)}") from e

    def _masked(self, e: Exception) -> str:
        """redis-py's message with this URL's secrets masked, pieces of them included."""
        return mask_known(str(e), self._secrets)

    def _pipeline(self, build) -> list:
        """One round trip: `build(pipe)` queues the commands; per-command error replies
        come back in place as exceptions."""
        def run():
            pipe = self.client.pipeline(transaction=False)
            build(pipe)
            return pipe.execute(raise_on_error=False)
        return self._call(run)

    def _exists(self, keys: list[str]) -> list[bool]:
        """One pipeline of TOUCH, one per key (one round trip): whether each is there,
        and, unlike EXISTS, a use of it, so a store evicting by LRU (maxmemory-policy
        allkeys-lru) keeps the pages every write finds still stored, the hot prefix
        first, instead of aging them while they are served from the device. An error
        reply is False, counted (errors, bad_replies) and logged."""
        names = [self._k(k) for k in keys]
        self._count(exists_calls=1)
        if not names:
            return []
        replies = self._pipeline(lambda p: [p.touch(n) for n in names])
        bad = [r for r in replies if isinstance(r, Exception)]
        if bad:
            self._count(bad_replies=len(bad), errors=len(bad))
            self.failure_log.failure("failed existence checks", "%d of %d TOUCH failed: %s",
                                     len(bad), len(names), _describe(bad[0]), count=len(bad))
        return [not isinstance(r, Exception) and bool(r) for r in replies]

    # ------------------------------------------------------------------ the interface
    def batch_exists(self, keys: list[str]) -> int:
        found = self._exists(keys)
        return found.index(False) if False in found else len(found)

    def batch_contains(self, keys: list[str]) -> list[bool]:
        return self._exists(keys)

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        """GET per key, in one pipeline; with max_value_bytes, GETRANGE up to one byte
        past the bound instead, so that a larger value costs no more than that (it is
        unreadable: a miss, counted, deleted). GETRANGE answers an empty value and a
        missing key alike: those few are told apart by EXISTS, in a second round trip."""
        names = [self._k(k) for k in keys]
        if not names:
            return []
        limit = self.max_value_bytes
        if limit is None:
            replies = self._pipeline(lambda p: [p.get(n) for n in names])
        else:
            replies = self._pipeline(lambda p: [p.getrange(n, 0, limit) for n in names])
            empty = [i for i, r in enumerate(replies) if r == b""]
            if empty:
                there = self._pipeline(lambda p: [p.exists(names[i]) for i in empty])
                for i, e in zip(empty, there):
                    replies[i] = b"" if e is True or e == 1 else None
        out: list[bytes | None] = []
        hits = nbytes = bad = 0
        foreign = []
        for n, r in zip(names, replies):
            if isinstance(r, Exception) or (r is not None and not isinstance(r, bytes)):
                # WRONGTYPE (someone else's value under our name) or the like: a miss.
                self.failure_log.failure("failed reads", "reading %s failed: %s", n, _describe(r))
                bad += 1
                if "WRONGTYPE" in str(r):
                    foreign.append(n)
                out.append(None)
            elif r is None:
                out.append(None)
            elif limit is not None and len(r) > limit:
                self.failure_log.failure("failed reads", "%s holds more than %d bytes, more than any stored "
                                         "object: not read", n, limit)
                bad += 1
                foreign.append(n)
                out.append(None)
            else:
                hits += 1
                nbytes += len(r)
                out.append(r)
        self._count(gets=len(names), hits=hits, bytes_read=nbytes, bad_replies=bad, errors=bad,
                    unreadable=len(foreign))
        if foreign:   # unreadable entries go, so that the next write stores the key again
            try:
                self._call(self.client.delete, *foreign)
            except StorageUnavailable as e:
                self.failure_log.failure("failed deletes", "removing unreadable %s failed: %s", foreign[0], e)
        return out

    def batch_set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        names = [self._k(k) for k in keys]
        vals = []
        for v in values:
            if isinstance(v, (bytearray, memoryview)):
                v = bytes(v)
            if not isinstance(v, bytes):
                raise TypeError(f"redis backend stores bytes, got {type(v).__name__}")
            vals.append(v)
        if not names:
            return []
        try:
            replies = self._pipeline(lambda p: [p.set(n, v) for n, v in zip(names, vals)])
        except StorageUnavailable:
            self._count(sets=len(names), set_failures=len(names))
            raise
        ok: list[bool] = []
        nbytes = failed = 0
        first_error = None
        for v, r in zip(vals, replies):
            if isinstance(r, Exception) or not r:
                failed += 1
                first_error = first_error or r
                ok.append(False)
            else:
                nbytes += len(v)
                ok.append(True)
        self._count(sets=len(names), set_failures=failed, bytes_written=nbytes)
        if failed:
            self.failure_log.failure("failed sets", "%d of %d sets refused: %s", failed,
                                     len(names), _describe(first_error), count=failed)
        return ok

    def set_if_absent(self, key: str, value: bytes) -> bool:
        """SET NX: atomic, one round trip."""
        name = self._k(key)
        if isinstance(value, (bytearray, memoryview)):
            value = bytes(value)
        if not isinstance(value, bytes):
            raise TypeError(f"redis backend stores bytes, got {type(value).__name__}")
        try:
            stored = bool(self._call(lambda: self.client.set(name, value, nx=True)))
        except StorageUnavailable:
            self._count(sets=1, set_failures=1)
            raise
        self._count(sets=1, bytes_written=len(value) if stored else 0)
        return stored

    def delete(self, key: str) -> bool:
        name = self._k(key)
        n = self._call(self.client.delete, name)
        self._count(deletes=1)
        return bool(n)

    def clear(self) -> None:
        """Delete every key named prefix + a storage key (SCAN, then DEL in batches).
        Keys of another prefix, even one that starts with this prefix, are left alone;
        never FLUSHDB."""
        pattern = _glob_escape(self.prefix) + "*"
        plen = len(self.prefix)

        def run():
            batch: list[bytes] = []
            for name in self.client.scan_iter(match=pattern, count=SCAN_COUNT):
                try:
                    rest = name[plen:].decode() if isinstance(name, bytes) else name[plen:]
                except UnicodeDecodeError:
                    continue
                if not KEY_RE.match(rest):
                    continue
                batch.append(name)
                if len(batch) >= DEL_BATCH:
                    self.client.delete(*batch)
                    batch.clear()
            if batch:
                self.client.delete(*batch)
        self._call(run)

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counters)
        return dict(out, backend=self.name, url=self.safe_url, prefix=self.prefix)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.failure_log.flush()
        try:
            self.pool.disconnect()
        except Exception as e:  # noqa: BLE001 - closing must not raise
            log.debug("redis backend: disconnect from %s: %s", self.safe_url, e)

    def __repr__(self) -> str:
        return f"RedisBackend(url={self.safe_url!r}, prefix={self.prefix!r})"


def _glob_escape(s: str) -> str:
    """Escape the characters Redis MATCH patterns treat specially."""
    return "".join("\\" + c if c in "*?[]\\^" else c for c in s)


def _describe(reply) -> str:
    """An error reply as its kind and text (OutOfMemoryError: ...), else its repr."""
    if isinstance(reply, Exception):
        return f"{type(reply).__name__}: {reply}"
    return repr(reply)
