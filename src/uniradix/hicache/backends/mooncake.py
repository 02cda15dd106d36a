"""The Mooncake backend: one Mooncake store object per key, named `prefix + key`,
holding the raw object bytes. Engines that point at the same master (and prefix) share
their L3.

Settings, the `MOONCAKE_*` environment variables of SGLang's HiCache docs, or the same
names in the extra config (lowercase without the prefix, e.g. "master", or the variable
name itself; the config wins over the environment):

    master               MOONCAKE_MASTER               host:port of mooncake_master (required)
    te_meta_data_server  MOONCAKE_TE_META_DATA_SERVER  default "P2PHANDSHAKE" (no metadata
                                                       service: peers exchange it directly)
    protocol             MOONCAKE_PROTOCOL             default "tcp" ("rdma" needs a NIC)
    device               MOONCAKE_DEVICE               RDMA device list, default ""
    global_segment_size  MOONCAKE_GLOBAL_SEGMENT_SIZE  memory this client lends to the
                                                       store, default 64 MiB
    local_buffer_size    MOONCAKE_LOCAL_BUFFER_SIZE    this client's transfer buffer,
                                                       default 64 MiB
    local_hostname       MOONCAKE_LOCAL_HOSTNAME       address peers reach this client at,
                                                       default 127.0.0.1 (one machine only)

Sizes are bytes, or a number with a unit (KB, MB, GB, TB or KiB, ...; powers of 1024).
Mooncake's own JSON names are accepted as aliases: master_server_address,
metadata_server, device_name. Config only: `prefix` (default "uniradix:"),
`connect_timeout` (seconds, default 2: how long the reachability probe of the master
waits) and `op_timeout` (seconds, default 10: how long one store call may take); how
the backend reaches the master and bounds its calls: see `backends/mooncake_client.py`.

What Mooncake does, and how the interface maps onto it:

- The store's memory is lent by its clients: each backend mounts `global_segment_size`
  bytes of its own process memory as a segment, and the master places objects in any
  mounted segment. An object in a segment whose client closes (or dies) is gone. For
  an L3 that outlives the engines, run a standalone store client (`mooncake_client`, or
  a process that only mounts a segment) and give the engines global_segment_size 0.
- Every value passes through the client's local buffer, so one value can be at most
  `local_buffer_size`; a larger one is refused (False). Batches are cut so that each
  fits in half the buffer.
- `put` on an existing key keeps the old value and still reports success; batch_set
  uses `upsert` (insert or replace), so a set replaces. Mooncake cannot store an empty
  value: batch_set reports False for b"" (the L3 objects above carry a header, never
  empty). Within one batch the last value for a key wins.
- A `get` of a missing key returns b"", the same as a failed get; batch_get resolves
  every b"" with an existence query (RPC_FAIL there = unreachable).
- Reads take a lease (the master's default_kv_lease_ttl) that blocks a plain remove;
  delete() and clear() remove with force=True, skipping the lease check. A reader that
  races a delete can get a torn object, which the checksum layer above rejects.
- clear() removes, on the master, every key matching prefix + a storage key
  (`remove_by_regex`), so other prefixes and foreign keys stay.
- Eviction belongs to the master (eviction_high_watermark_ratio / eviction_ratio).

The `mooncake` package is imported only when a backend is built:
`pip install mooncake-transfer-engine-non-cuda` (or the `storage` extra), and the
library needs libibverbs (`apt-get install libibverbs1`) even for TCP.
"""
from __future__ import annotations

import logging
import math
import os
import re

from ..log_limit import LogLimiter
from ..storage import StorageBackend, StorageUnavailable, check_key
from .mooncake_client import (
    MAX_HUNG,
    OBJECT_NOT_FOUND,
    OK,
    CallTimedOut,
    MooncakeClient,
    _code,
    _split_address,
)

log = logging.getLogger("uniradix.hicache")

DEFAULT_PREFIX = "uniradix:"
DEFAULT_SEGMENT = 64 << 20
DEFAULT_CONNECT_TIMEOUT = 2.0
DEFAULT_OP_TIMEOUT = 10.0
PIP_PACKAGE = "mooncake-transfer-engine-non-cuda"

# setting -> (environment variable, default); None: required
SETTINGS = {
    "master": ("MOONCAKE_MASTER", None),
    "te_meta_data_server": ("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
    "protocol": ("MOONCAKE_PROTOCOL", "tcp"),
    "device": ("MOONCAKE_DEVICE", ""),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE", DEFAULT_SEGMENT),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_SEGMENT),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
}
ALIASES = {"master_server_address": "master", "metadata_server": "te_meta_data_server",
           "device_name": "device"}
OWN = ("prefix", "connect_timeout", "op_timeout")   # config only
CONFIG_KEYS = frozenset(SETTINGS) | frozenset(env for env, _ in SETTINGS.values()) \
    | frozenset(ALIASES) | frozenset(OWN)

NEEDED_CALLS = ("setup", "close", "batch_is_exist", "get_batch", "get", "upsert_batch", "upsert",
                "remove", "remove_by_regex")
EXISTS_CHUNK = 512   # keys per existence query: batch_exists stops at the first short one
MAX_SIZE = (1 << 63) - 1   # sizes go to the store as 64-bit integers

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.:/-]{0,128}\Z")


def _store_class():
    """`mooncake.store.MooncakeDistributedStore`, imported on first use."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        hint = ""
        if "libibverbs" in str(e):
            hint = " and its libibverbs library (apt-get install libibverbs1)"
        raise ImportError(f"the mooncake storage backend needs the Mooncake store{hint}: "
                          f"pip install {PIP_PACKAGE}  (or pip install 'uniradix[storage]'); "
                          f"importing mooncake.store failed: {e}") from e
    lacking = [m for m in NEEDED_CALLS if not hasattr(MooncakeDistributedStore, m)]
    if lacking:
        raise ImportError(f"the mooncake storage backend needs a newer Mooncake store (it lacks "
                          f"{', '.join(lacking)}): pip install -U '{PIP_PACKAGE}>=0.3.13'")
    return MooncakeDistributedStore


def parse_size(value, what: str) -> int:
    """Bytes from an int or a string such as "64MB", "4 GiB", "1048576"."""
    if isinstance(value, bool):
        raise ValueError(f"mooncake backend: {what} must be a size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        n = int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))
    else:
        raise ValueError(f"mooncake backend: {what} must be a whole number of bytes or a size "
                         f"like '64MB', got {value!r}")
    if n < 0:
        raise ValueError(f"mooncake backend: {what} must not be negative, got {value!r}")
    if n > MAX_SIZE:
        raise ValueError(f"mooncake backend: {what} must be less than 2**63 bytes, got {value!r}")
    return n


def resolve_settings(config: dict | None = None, environ=None) -> dict:
    """The settings from `config` over the MOONCAKE_* variables of `environ` (default
    os.environ) over the defaults. Unknown keys and a missing master are ValueErrors."""
    environ = os.environ if environ is None else environ
    config = dict(config or {})
    unknown = sorted(set(config) - CONFIG_KEYS)
    if unknown:
        raise ValueError(f"mooncake backend: unknown setting(s) {unknown}; it takes "
                         f"{', '.join([*SETTINGS, *OWN])} (or the MOONCAKE_* names, "
                         f"or {', '.join(ALIASES)})")
    given: dict[str, tuple[str, object]] = {}
    for k, v in config.items():
        name = ALIASES.get(k) or next((s for s, (env, _) in SETTINGS.items() if env == k), k)
        if name in given and given[name][1] != v:
            raise ValueError(f"mooncake backend: {name} given twice ({given[name][0]}={given[name][1]!r}, "
                             f"{k}={v!r})")
        given[name] = (k, v)
    out: dict = {}
    where: dict[str, str] = {}   # setting -> how messages name it (and where it came from)
    for name, (env, default) in SETTINGS.items():
        if name in given:
            k, out[name] = given[name]
            where[name] = name if k == name else f"{name} (given as {k})"
        elif environ.get(env, "") != "":
            out[name], where[name] = environ[env], f"{name} (from the environment, {env})"
        else:
            out[name], where[name] = default, name
    if out["master"] is None and "master" not in given:
        raise ValueError("mooncake backend: no master address: set MOONCAKE_MASTER=host:port "
                         "or 'master' in the extra config")
    for name in ("master", "te_meta_data_server", "protocol", "device", "local_hostname"):
        if not isinstance(out[name], str):
            what = "a string host:port" if name == "master" else "a string"
            raise ValueError(f"mooncake backend: {where[name]} must be {what}, got {out[name]!r}")
    if not out["master"].strip():
        raise ValueError("mooncake backend: no master address: set MOONCAKE_MASTER=host:port "
                         "or 'master' in the extra config")
    for name in ("master", "te_meta_data_server", "protocol", "local_hostname"):
        out[name] = out[name].strip()
        if not out[name]:
            raise ValueError(f"mooncake backend: {where[name]} must not be empty")
    _split_address(out["master"])
    for name in ("global_segment_size", "local_buffer_size"):
        out[name] = parse_size(out[name], where[name])
    if out["local_buffer_size"] < 1024:
        raise ValueError(f"mooncake backend: {where['local_buffer_size']} must be at least 1 KiB, "
                         f"got {out['local_buffer_size']}")
    prefix = given.get("prefix", (None, DEFAULT_PREFIX))[1]
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(f"mooncake backend: prefix must be up to 128 of A-Z a-z 0-9 _ . : / -, "
                         f"got {prefix!r}")
    out["prefix"] = prefix
    for name, default in (("connect_timeout", DEFAULT_CONNECT_TIMEOUT), ("op_timeout", DEFAULT_OP_TIMEOUT)):
        timeout = given.get(name, (None, default))[1]
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not 0 < timeout < math.inf):
            raise ValueError(f"mooncake backend: {name} must be a positive, finite number "
                             f"of seconds, got {timeout!r}")
        out[name] = float(timeout)
    return out


class MooncakeBackend(StorageBackend):
    """The storage interface over one `MooncakeClient`: keys named prefix + key, values
    checked and cut to fit the client's local buffer, Mooncake's answers mapped onto
    the interface's (see the module docstring)."""

    name = "mooncake"
    CONFIG_KEYS = CONFIG_KEYS
    COUNTERS = ("gets", "hits", "sets", "set_failures", "errors", "bytes_written", "bytes_read",
                "exists_calls", "deletes", "connects", "unreadable")

    def __init__(self, config: dict | None = None) -> None:
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"mooncake backend: config must be a dict, got {type(config).__name__}")
        s = resolve_settings(config)
        self.master = s["master"]
        self.prefix = s["prefix"]
        self._batch_bytes = max(1, s["local_buffer_size"] // 2)
        self._max_value = s["local_buffer_size"]
        self._clear_regex = ("^" + self.prefix.replace(".", r"\.")
                             + r"[0-9a-f]{64}(\.[A-Za-z0-9_-]{1,32})?$")
        self.failure_log = LogLimiter(log, f"mooncake backend (master {self.master})")
        self.client = MooncakeClient(s, _store_class(), self.COUNTERS)   # connects

    @property
    def settings(self) -> dict:
        return self.client.settings

    @property
    def counters(self) -> dict:
        return self.client.counters

    @property
    def generation(self) -> int:
        """The client's (StorageBackend.generation): bumped when the master answers again
        after a call failed to reach it."""
        return self.client.generation

    def _names(self, keys: list[str]) -> list[str]:
        if not isinstance(keys, (list, tuple)):
            raise TypeError(f"keys must be a list, got {type(keys).__name__}")
        return [self.prefix + check_key(k) for k in keys]

    def batch_exists(self, keys: list[str]) -> int:
        names = self._names(keys)
        self.client.count(exists_calls=1)
        if not names:
            return 0
        run = 0
        with self.client.store() as store:
            for i in range(0, len(names), EXISTS_CHUNK):
                for c in self.client.call_batch(store.batch_is_exist, names[i:i + EXISTS_CHUNK],
                                                "existence queries"):
                    if c == 1:
                        run += 1
                        continue
                    if c != 0:
                        self.client.check_rc(c, "an existence query")
                        self.failure_log.failure("failed existence checks",
                                                 "existence query failed: %s", _code(c))
                        self.client.count(errors=1)
                    return run
        return run

    def batch_contains(self, keys: list[str]) -> list[bool]:
        """One batch_is_exist for all the keys (no chunks: every key is answered)."""
        names = self._names(keys)
        self.client.count(exists_calls=1)
        if not names:
            return []
        with self.client.store() as store:
            codes = self.client.call_batch(store.batch_is_exist, names, "existence queries")
        failed = [c for c in codes if c not in (0, 1)]
        for c in failed:
            self.client.check_rc(c, "an existence query")
        if failed:
            self.client.count(errors=len(failed))
            self.failure_log.failure("failed existence checks", "%d of %d existence queries failed: %s",
                                     len(failed), len(names), _code(failed[0]), count=len(failed))
        return [c == 1 for c in codes]

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        names = self._names(keys)
        if not names:
            return []
        with self.client.store() as store:
            out, unreadable = _get_all(self.client, store, names)
        nbytes = sum(len(v) for v in out if v is not None)
        oversized = self._drop_oversized(names, out)
        hits = sum(v is not None for v in out)
        if unreadable:
            self.failure_log.failure("failed reads", "%d of %d objects present could not be read",
                                     unreadable, len(names), count=unreadable)
        self.client.count(gets=len(names), hits=hits, errors=unreadable + oversized, unreadable=oversized,
                          bytes_read=nbytes)
        return out

    def _drop_oversized(self, names: list[str], out: list) -> int:
        """Values larger than any its readers store (max_value_bytes; the local buffer
        bounds what a get can bring) are no stored object: misses, removed so that the
        next write stores the key again. Returns how many."""
        limit = self.max_value_bytes
        if limit is None:
            return 0
        big = [i for i, v in enumerate(out) if v is not None and len(v) > limit]
        for i in big:
            self.failure_log.failure("unreadable entries", "%s holds %d bytes, more than any stored object "
                                     "(%d): removed", names[i], len(out[i]), limit)
            out[i] = None
            try:
                with self.client.store() as store:
                    self.client.call(store.remove, names[i], True)
            except StorageUnavailable as e:
                self.failure_log.failure("failed deletes", "removing %s failed: %s", names[i], e)
        return len(big)

    def batch_set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        names = self._names(keys)
        sizes = [_nbytes(v) for v in values]
        if not names:
            return []
        last = {n: i for i, n in enumerate(names)}   # the last value for a key wins
        todo = []
        for i in last.values():
            if 0 < sizes[i] <= self._max_value:
                todo.append(i)
            elif sizes[i]:
                self.failure_log.failure("failed sets", "a %d-byte value is larger than "
                                         "local_buffer_size (%d): not stored", sizes[i], self._max_value)
        try:
            with self.client.store() as store:
                ok = _upsert_all(self.client, store, names, values, _batches(todo, sizes, self._batch_bytes),
                                 self.failure_log)
        except StorageUnavailable:
            self.client.count(sets=len(names), set_failures=len(names))
            raise
        result = [ok[last[n]] for n in names]   # earlier duplicates: the fate of the last
        self.client.count(sets=len(names), set_failures=result.count(False),
                          bytes_written=sum(sizes[i] for i in last.values() if ok[i]))
        return result

    def set_if_absent(self, key: str, value: bytes) -> bool:
        """A plain put: Mooncake keeps a value already there (and answers success either
        way), so of two engines racing the first one's value stays. True: stored, or a
        value was there already (read back to know which)."""
        name = self._names([key])[0]
        size = _nbytes(value)
        if not 0 < size <= self._max_value:
            self.client.count(sets=1, set_failures=1)
            return False
        try:
            with self.client.store() as store:
                rc = self.client.call(store.put, name, value)
            self.client.check_rc(rc, "a put")
        except StorageUnavailable:
            self.client.count(sets=1, set_failures=1)
            raise
        if rc != OK:
            self.failure_log.failure("failed sets", "storing %s failed: %s", name, _code(rc))
        self.client.count(sets=1, set_failures=int(rc != OK), bytes_written=size if rc == OK else 0)
        return rc == OK

    def delete(self, key: str) -> bool:
        name = self._names([key])[0]
        with self.client.store() as store:
            rc = self.client.call(store.remove, name, True)
        self.client.check_rc(rc, "a remove")
        self.client.count(deletes=1)
        if rc == OK:
            return True
        if rc != OBJECT_NOT_FOUND:
            self.failure_log.failure("failed deletes", "removing %s failed: %s", name, _code(rc))
            self.client.count(errors=1)
        return False

    def clear(self) -> None:
        """Remove every key named prefix + a storage key, on the master (by regex);
        other prefixes' keys and keys that are not storage keys stay."""
        with self.client.store() as store:
            rc = self.client.call(store.remove_by_regex, self._clear_regex, True)
        self.client.check_rc(rc, "a remove by pattern")
        if rc < 0:
            raise self.client.unavailable(f"refused to clear prefix {self.prefix!r}: {_code(rc)}")

    def stats(self) -> dict:
        counters, connected = self.client.snapshot()
        return dict(counters, backend=self.name, master=self.master, prefix=self.prefix,
                    connected=connected)

    def close(self) -> None:
        """Close the client (see MooncakeClient.close), then report the failures not
        yet logged."""
        if self.client.close():
            self.failure_log.flush()

    def __repr__(self) -> str:
        return f"MooncakeBackend(master={self.master!r}, prefix={self.prefix!r})"


def _get_all(client: MooncakeClient, store, names: list[str]) -> tuple[list[bytes | None], int]:
    """The values of `names` (None: absent), and how many present ones could not be
    read. A get answers b"" for a miss and for a failure alike (no room in the local
    buffer, the master gone): ask which, and fetch again what is there."""
    out: list[bytes | None] = [None] * len(names)
    unreadable = 0
    pending = list(range(len(names)))
    first = True
    while pending:
        got = client.call_batch(store.get_batch, [names[i] for i in pending], "gets")
        empty = []
        for i, v in zip(pending, got):
            if v:
                out[i] = bytes(v)
            else:
                empty.append(i)
        if not empty:
            break
        codes = client.call_batch(store.batch_is_exist, [names[i] for i in empty], "existence queries")
        again = []
        for i, c in zip(empty, codes):
            if c == 1:
                again.append(i)
            elif c != 0:
                client.check_rc(c, "an existence query")
                unreadable += 1
        if len(again) == len(pending) and not first:
            # no progress: one at a time, then give up on what still fails
            for i in again:
                v = client.call(store.get, names[i])
                if v:
                    out[i] = bytes(v)
                else:
                    unreadable += 1
            break
        first = False
        pending = again
    return out, unreadable


def _upsert_all(client: MooncakeClient, store, names: list[str], values, batches, failure_log) -> list[bool]:
    """Per name, whether its value was stored: one upsert_batch per batch (of indexes
    into names), and a batch refused whole key by key."""
    ok = [False] * len(names)
    for chunk in batches:
        rc = client.call(store.upsert_batch, [names[i] for i in chunk], [values[i] for i in chunk])
        client.check_rc(rc, "a batch upsert")
        if rc == OK:
            for i in chunk:
                ok[i] = True
            continue
        for i in chunk:
            rc = client.call(store.upsert, names[i], values[i])
            client.check_rc(rc, "an upsert")
            ok[i] = rc == OK
            if rc != OK:
                failure_log.failure("failed sets", "storing %s failed: %s", names[i], _code(rc))
    return ok


def _batches(idx: list[int], sizes: list[int], limit: int):
    """`idx` cut into runs whose sizes add up to at most `limit` bytes (a larger
    value alone)."""
    chunk, size = [], 0
    for i in idx:
        n = sizes[i]
        if chunk and size + n > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(i)
        size += n
    if chunk:
        yield chunk


def _nbytes(value) -> int:
    """The size of a value to store; anything but bytes is a TypeError."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"mooncake backend stores bytes, got {type(value).__name__}")
    return memoryview(value).nbytes


# MAX_HUNG and CallTimedOut live with the client; callers and tests know them here
__all__ = ["CONFIG_KEYS", "EXISTS_CHUNK", "MAX_HUNG", "PIP_PACKAGE", "CallTimedOut", "MooncakeBackend",
           "parse_size", "resolve_settings"]
