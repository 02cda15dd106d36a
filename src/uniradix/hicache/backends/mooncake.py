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
waits, see below) and `op_timeout` (seconds, default 10: how long one store call may
take, see below).

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

Reaching the master: the constructor connects (validating settings first: a bad or
missing setting is a ValueError). If the master cannot be reached it logs a warning and
does not fail; every call then raises `StorageUnavailable` naming the master until it
answers, when the backend connects by itself. Before connecting, and after any call
that failed to reach the master, a plain TCP connect to the master's port (at most
`connect_timeout`) decides at once whether to try: a master that is down costs a
refused connect, not Mooncake's own retries (20 attempts of seconds each at setup, a
reconnect of ~4 s per call). A port that accepts but never answers can still hold
setup for MC_STORE_CLIENT_SETUP_RETRIES (default 20) times the RPC timeout; the
constructor and every call wait for it at most `op_timeout` (see below).

Bounded calls: the Mooncake client has no timeout of its own for a call, so each runs
on one of the backend's daemon threads and is waited for at most `op_timeout`; past it
the call raises `StorageUnavailable` and is left to return on its thread (a client
that is still setting up is closed when it does). While MAX_HUNG calls are left so,
new calls fail at once. close() waits at most `op_timeout` for calls in flight, and
does not close a client a call is still inside (the process ends it).

The client also listens itself, for its peers: the transfer engine's handshake port is
bound to 0.0.0.0 (hard-coded in the transfer engine) and the TCP transport to all
addresses.

The `mooncake` package is imported only when a backend is built:
`pip install mooncake-transfer-engine-non-cuda` (or the `storage` extra), and the
library needs libibverbs (`apt-get install libibverbs1`) even for TCP.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import socket
import threading
import time

from ..io_threads import DaemonThreads
from ..log_limit import LogLimiter
from ..storage import StorageBackend, StorageUnavailable, check_key

log = logging.getLogger("uniradix.hicache")

DEFAULT_PREFIX = "uniradix:"
DEFAULT_SEGMENT = 64 << 20
DEFAULT_CONNECT_TIMEOUT = 2.0
DEFAULT_OP_TIMEOUT = 10.0
#: calls past op_timeout still inside the client beyond which new calls fail at once
MAX_HUNG = 4
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

# Mooncake error codes (mooncake-store/include/types.h) this backend tells apart
OK = 0
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
UNAVAILABLE = {RPC_FAIL: "RPC_FAIL", -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
               -1011: "UNAVAILABLE_IN_CURRENT_MODE", -103: "CLIENT_NOT_FOUND"}
CODE_NAMES = {-1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
              -200: "NO_AVAILABLE_HANDLE", -600: "INVALID_PARAMS", -700: "INVALID_WRITE",
              -701: "INVALID_READ", -704: "OBJECT_NOT_FOUND", -706: "OBJECT_HAS_LEASE",
              -708: "OBJECT_HAS_REPLICATION_TASK", -800: "TRANSFER_FAIL", **UNAVAILABLE}

NEEDED_CALLS = ("setup", "close", "batch_is_exist", "get_batch", "get", "upsert_batch", "upsert",
                "remove", "remove_by_regex")
EXISTS_CHUNK = 512   # keys per existence query: batch_exists stops at the first short one
MAX_SIZE = (1 << 63) - 1   # sizes go to the store as 64-bit integers

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.:/-]{0,128}\Z")


def _code(rc: int) -> str:
    return f"{rc} ({CODE_NAMES.get(rc, 'error')})"


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


def _split_address(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"mooncake backend: master must be host:port, got {addr!r}")
    return host, int(port)


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


class CallTimedOut(StorageUnavailable):
    """A store call took longer than op_timeout (it goes on, on its own thread)."""


class MooncakeBackend(StorageBackend):
    """See the module docstring for the settings and for what Mooncake does."""

    name = "mooncake"
    CONFIG_KEYS = CONFIG_KEYS

    def __init__(self, config: dict | None = None) -> None:
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"mooncake backend: config must be a dict, got {type(config).__name__}")
        s = resolve_settings(config)
        self.settings = s
        self.master = s["master"]
        self.prefix = s["prefix"]
        self._host_port = _split_address(self.master)
        self._batch_bytes = max(1, s["local_buffer_size"] // 2)
        self._max_value = s["local_buffer_size"]
        self._clear_regex = ("^" + self.prefix.replace(".", r"\.")
                             + r"[0-9a-f]{64}(\.[A-Za-z0-9_-]{1,32})?$")
        self._cls = _store_class()
        self._lock = threading.Lock()          # counters, state
        self._connect_lock = threading.Lock()  # one setup at a time
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._closed = False
        self._store = None
        self._suspect = False   # the last call failed to reach the master: probe first
        # bumped each time the master answers again after a call failed to reach it (it
        # may have restarted, and a new master knows no objects): the storage tier then
        # believes nothing stored and checks the witness again
        self.generation = 0
        self._hung = 0          # calls abandoned past op_timeout, still inside the client
        self._calls = DaemonThreads(MAX_HUNG + 4, "uniradix-mooncake")
        self.counters = dict.fromkeys(("gets", "hits", "sets", "set_failures", "errors",
                                       "bytes_written", "bytes_read", "exists_calls", "deletes",
                                       "connects", "unreadable"), 0)
        self.failure_log = LogLimiter(log, f"mooncake backend (master {self.master})")
        try:
            self._connect()
        except StorageUnavailable as e:
            log.warning("%s; L3 calls fail until it answers", e)

    # ------------------------------------------------------------------ plumbing
    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self.counters[k] += v

    def _unavailable(self, what: str) -> StorageUnavailable:
        """Count one error, remember to probe before the next call, and build the
        exception (naming the master) for the caller to raise."""
        with self._lock:
            self.counters["errors"] += 1
            self._suspect = True
        return StorageUnavailable(f"mooncake backend: master {self.master} {what}")

    def _probe(self) -> None:
        try:
            with socket.create_connection(self._host_port, timeout=self.settings["connect_timeout"]):
                pass
        except OSError as e:
            raise self._unavailable(f"is unreachable: {e}") from e

    def _connect(self) -> None:
        """Set up a Mooncake client against the master (probing it first)."""
        self._probe()
        s = self.settings
        store = self._cls()
        try:
            rc = self._rpc(store.setup, s["local_hostname"], s["te_meta_data_server"], s["global_segment_size"],
                           s["local_buffer_size"], s["protocol"], s["device"], self.master,
                           abandoned=lambda: _close_quietly(store))
        except CallTimedOut:
            raise   # closed when the setup returns
        except StorageUnavailable:
            _close_quietly(store)
            raise
        except (TypeError, ValueError) as e:
            _close_quietly(store)
            raise self._unavailable(f"client setup failed: {e}") from e
        if rc != OK:
            _close_quietly(store)
            raise self._unavailable(f"refused the client setup (setup returned {_code(rc)}; "
                                    f"is a mooncake_master listening there?)")
        with self._lock:
            self._store = store
            self._suspect = False
            self.generation += bool(self.counters["connects"])
            self.counters["connects"] += 1

    @contextlib.contextmanager
    def _op(self):
        """One call: the connected store, or StorageUnavailable. close() waits for the
        calls in flight."""
        with self._lock:
            if self._closed:
                raise StorageUnavailable(f"mooncake backend (master {self.master}) is closed")
            self._inflight += 1
        try:
            if self._store is None:
                if not self._connect_lock.acquire(blocking=False):
                    raise self._unavailable("is not connected yet (another call is connecting)")
                try:
                    if self._store is None:
                        self._connect()
                finally:
                    self._connect_lock.release()
            elif self._suspect:
                self._probe()
                with self._lock:
                    if self._suspect:
                        self._suspect = False
                        self.generation += 1
            yield self._store
        finally:
            with self._lock:
                self._inflight -= 1
                self._idle.notify_all()

    def _rpc(self, fn, *args, abandoned=None):
        """A store call, on a daemon thread, waited for at most op_timeout (CallTimedOut
        past it; `abandoned()` runs once the call returns after all). An exception from
        the binding is the store failing."""
        name = getattr(fn, "__name__", fn)
        with self._lock:
            hung = self._hung
        if hung >= MAX_HUNG:
            raise self._unavailable(f"has {hung} calls that did not return within op_timeout "
                                    f"({self.settings['op_timeout']:g} s)")
        fut = self._calls.submit(fn, *args)
        try:
            return fut.result(timeout=self.settings["op_timeout"])
        except (RuntimeError, OSError) as e:   # TimeoutError is an OSError: told apart by done()
            if fut.done():
                raise self._unavailable(f"call {name} failed: {e}") from e
        if not fut.cancel():   # it runs on: counted until it returns
            with self._lock:
                self._hung += 1
            fut.add_done_callback(lambda _: self._returned(abandoned))
        with self._lock:
            self.counters["errors"] += 1
            self._suspect = True
        raise CallTimedOut(f"mooncake backend: master {self.master} did not answer {name} within "
                           f"op_timeout ({self.settings['op_timeout']:g} s)")

    def _returned(self, abandoned) -> None:
        """A call abandoned past op_timeout has returned."""
        with self._lock:
            self._hung -= 1
            self._idle.notify_all()
        if abandoned is not None:
            abandoned()

    def _check_rc(self, rc: int, what: str) -> None:
        if rc in UNAVAILABLE:
            raise self._unavailable(f"did not answer {what}: {_code(rc)}")

    def _names(self, keys: list[str]) -> list[str]:
        if not isinstance(keys, (list, tuple)):
            raise TypeError(f"keys must be a list, got {type(keys).__name__}")
        return [self.prefix + check_key(k) for k in keys]

    # ------------------------------------------------------------------ the interface
    def batch_exists(self, keys: list[str]) -> int:
        names = self._names(keys)
        self._count(exists_calls=1)
        if not names:
            return 0
        run = 0
        with self._op() as store:
            for i in range(0, len(names), EXISTS_CHUNK):
                chunk = names[i:i + EXISTS_CHUNK]
                codes = self._rpc(store.batch_is_exist, chunk)
                if len(codes) != len(chunk):
                    raise self._unavailable(f"answered {len(codes)} of {len(chunk)} existence queries")
                for c in codes:
                    if c == 1:
                        run += 1
                        continue
                    if c != 0:
                        self._check_rc(c, "an existence query")
                        self.failure_log.failure("failed existence checks",
                                                 "existence query failed: %s", _code(c))
                        self._count(errors=1)
                    return run
        return run

    def batch_contains(self, keys: list[str]) -> list[bool]:
        """One batch_is_exist for all the keys (no chunks: every key is answered)."""
        names = self._names(keys)
        self._count(exists_calls=1)
        if not names:
            return []
        with self._op() as store:
            codes = self._rpc(store.batch_is_exist, names)
        if len(codes) != len(names):
            raise self._unavailable(f"answered {len(codes)} of {len(names)} existence queries")
        failed = [c for c in codes if c not in (0, 1)]
        for c in failed:
            self._check_rc(c, "an existence query")
        if failed:
            self._count(errors=len(failed))
            self.failure_log.failure("failed existence checks", "%d of %d existence queries failed: %s",
                                     len(failed), len(names), _code(failed[0]), count=len(failed))
        return [c == 1 for c in codes]

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        names = self._names(keys)
        if not names:
            return []
        out: list[bytes | None] = [None] * len(names)
        unreadable = 0
        with self._op() as store:
            pending = list(range(len(names)))
            first = True
            while pending:
                # b"" is a miss or a failure (no room in the local buffer, the master
                # gone): ask which, and fetch again what is there.
                got = self._rpc(store.get_batch, [names[i] for i in pending])
                if len(got) != len(pending):
                    raise self._unavailable(f"answered {len(got)} of {len(pending)} gets")
                empty = []
                for i, v in zip(pending, got):
                    if v:
                        out[i] = bytes(v)
                    else:
                        empty.append(i)
                if not empty:
                    break
                codes = self._rpc(store.batch_is_exist, [names[i] for i in empty])
                if len(codes) != len(empty):
                    raise self._unavailable(f"answered {len(codes)} of {len(empty)} existence queries")
                again = []
                for i, c in zip(empty, codes):
                    if c == 1:
                        again.append(i)
                    elif c != 0:
                        self._check_rc(c, "an existence query")
                        unreadable += 1
                if len(again) == len(pending) and not first:
                    # no progress: one at a time, then give up on what still fails
                    for i in again:
                        v = self._rpc(store.get, names[i])
                        if v:
                            out[i] = bytes(v)
                        else:
                            unreadable += 1
                    break
                first = False
                pending = again
        nbytes = sum(len(v) for v in out if v is not None)
        oversized = self._drop_oversized(names, out)
        hits = sum(v is not None for v in out)
        if unreadable:
            self.failure_log.failure("failed reads", "%d of %d objects present could not be read",
                                     unreadable, len(names), count=unreadable)
        self._count(gets=len(names), hits=hits, errors=unreadable + oversized, unreadable=oversized,
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
                with self._op() as store:
                    self._rpc(store.remove, names[i], True)
            except StorageUnavailable as e:
                self.failure_log.failure("failed deletes", "removing %s failed: %s", names[i], e)
        return len(big)

    def batch_set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        names = self._names(keys)
        for v in values:
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise TypeError(f"mooncake backend stores bytes, got {type(v).__name__}")
        if not names:
            return []
        ok = [False] * len(names)
        last = {n: i for i, n in enumerate(names)}   # the last value for a key wins
        todo = []
        for i in last.values():
            size = memoryview(values[i]).nbytes
            if 0 < size <= self._max_value:
                todo.append(i)
            elif size:
                self.failure_log.failure("failed sets", "a %d-byte value is larger than "
                                         "local_buffer_size (%d): not stored", size, self._max_value)
        try:
            with self._op() as store:
                for chunk in self._chunks(todo, values):
                    rc = self._rpc(store.upsert_batch, [names[i] for i in chunk],
                                   [values[i] for i in chunk])
                    self._check_rc(rc, "a batch upsert")
                    if rc == OK:
                        for i in chunk:
                            ok[i] = True
                        continue
                    for i in chunk:   # the batch is refused whole: key by key
                        rc = self._rpc(store.upsert, names[i], values[i])
                        self._check_rc(rc, "an upsert")
                        ok[i] = rc == OK
                        if rc != OK:
                            self.failure_log.failure("failed sets", "storing %s failed: %s",
                                                     names[i], _code(rc))
        except StorageUnavailable:
            self._count(sets=len(names), set_failures=len(names))
            raise
        result = [ok[last[n]] for n in names]   # earlier duplicates: the fate of the last
        self._count(sets=len(names), set_failures=result.count(False),
                    bytes_written=sum(memoryview(values[i]).nbytes for i in last.values() if ok[i]))
        return result

    def _chunks(self, idx: list[int], values):
        chunk, size = [], 0
        for i in idx:
            n = memoryview(values[i]).nbytes
            if chunk and size + n > self._batch_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(i)
            size += n
        if chunk:
            yield chunk

    def set_if_absent(self, key: str, value: bytes) -> bool:
        """A plain put: Mooncake keeps a value already there (and answers success either
        way), so of two engines racing the first one's value stays. True: stored, or a
        value was there already (read back to know which)."""
        name = self._names([key])[0]
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"mooncake backend stores bytes, got {type(value).__name__}")
        size = memoryview(value).nbytes
        if not 0 < size <= self._max_value:
            self._count(sets=1, set_failures=1)
            return False
        try:
            with self._op() as store:
                rc = self._rpc(store.put, name, value)
            self._check_rc(rc, "a put")
        except StorageUnavailable:
            self._count(sets=1, set_failures=1)
            raise
        if rc != OK:
            self.failure_log.failure("failed sets", "storing %s failed: %s", name, _code(rc))
        self._count(sets=1, set_failures=int(rc != OK), bytes_written=size if rc == OK else 0)
        return rc == OK

    def delete(self, key: str) -> bool:
        name = self._names([key])[0]
        with self._op() as store:
            rc = self._rpc(store.remove, name, True)
        self._check_rc(rc, "a remove")
        self._count(deletes=1)
        if rc == OK:
            return True
        if rc != OBJECT_NOT_FOUND:
            self.failure_log.failure("failed deletes", "removing %s failed: %s", name, _code(rc))
            self._count(errors=1)
        return False

    def clear(self) -> None:
        """Remove every key named prefix + a storage key, on the master (by regex);
        other prefixes' keys and keys that are not storage keys stay."""
        with self._op() as store:
            rc = self._rpc(store.remove_by_regex, self._clear_regex, True)
        self._check_rc(rc, "a remove by pattern")
        if rc < 0:
            raise self._unavailable(f"refused to clear prefix {self.prefix!r}: {_code(rc)}")

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counters)
            connected = self._store is not None and not self._suspect
        return dict(out, backend=self.name, master=self.master, prefix=self.prefix,
                    connected=connected)

    def close(self) -> None:
        """Wait for the calls in flight (each ends within op_timeout: returned, or given
        up and left running), then close the client (its segment, and the objects the
        master placed there, leave the store). Calls given up already are not waited
        for: they may never return."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + self.settings["op_timeout"]
            while self._inflight and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())
            busy = self._inflight + self._hung
            store, self._store = self._store, None
        if store is not None and busy:   # closing a client a call is still inside could crash
            log.warning("mooncake backend (master %s): %d call(s) still running at close; the client "
                        "is left to the process's end", self.master, busy)
        elif store is not None:
            _close_quietly(store)
        self._calls.shutdown()
        self.failure_log.flush()

    def __repr__(self) -> str:
        return f"MooncakeBackend(master={self.master!r}, prefix={self.prefix!r})"


def _close_quietly(store) -> None:
    try:
        store.close()
    except Exception as e:  # noqa: BLE001 - closing must not raise
        log.debug("mooncake backend: close: %s", e)
