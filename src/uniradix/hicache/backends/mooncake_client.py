"""One Mooncake client against its master, kept usable for the Mooncake backend
(`mooncake.py`): it connects (and reconnects) by itself, bounds every call in time,
and counts what failed. The backend says what to call; this module says how.

Reaching the master: the client connects when it is built (the settings are validated
before, by `mooncake.resolve_settings`). If the master cannot be reached it does not
fail (whether a start may go on without it is the start-up's probe to say:
backends.open_backend); every call then raises `StorageUnavailable` naming the master
until it answers, when the client connects by itself. Before connecting, and
after any call that failed to reach the master, a plain TCP connect to the master's
port (at most `connect_timeout`) decides at once whether to try: a master that is down
costs a refused connect, not Mooncake's own retries (20 attempts of seconds each at
setup, a reconnect of ~4 s per call). A port that accepts but never answers can still
hold setup for MC_STORE_CLIENT_SETUP_RETRIES (default 20) times the RPC timeout; the
constructor and every call wait for it at most `op_timeout` (see below).

Bounded calls: the Mooncake client has no timeout of its own for a call, so each runs
on one of this client's daemon threads and is waited for at most `op_timeout`; past it
the call raises `StorageUnavailable` and is left to return on its thread (a client
that is still setting up is closed when it does). While MAX_HUNG calls are left so,
new calls fail at once. close() waits at most `op_timeout` for calls in flight, and
does not close a client a call is still inside (the process ends it).

The client also listens itself, for its peers: the transfer engine's handshake port is
bound to 0.0.0.0 (hard-coded in the transfer engine) and the TCP transport to all
addresses.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import socket
import threading
import time

from ..io_threads import DaemonThreads
from ..storage import StorageUnavailable

log = logging.getLogger("uniradix.hicache")

#: calls past op_timeout still inside the client beyond which new calls fail at once
MAX_HUNG = 4

# Mooncake error codes (mooncake-store/include/types.h) the backend tells apart
OK = 0
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
UNAVAILABLE = {RPC_FAIL: "RPC_FAIL", -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
               -1011: "UNAVAILABLE_IN_CURRENT_MODE", -103: "CLIENT_NOT_FOUND"}
CODE_NAMES = {-1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
              -200: "NO_AVAILABLE_HANDLE", -600: "INVALID_PARAMS", -700: "INVALID_WRITE",
              -701: "INVALID_READ", -704: "OBJECT_NOT_FOUND", -706: "OBJECT_HAS_LEASE",
              -708: "OBJECT_HAS_REPLICATION_TASK", -800: "TRANSFER_FAIL", **UNAVAILABLE}


def master_binary() -> str | None:
    """The mooncake_master executable: the one inside the `mooncake` package (its console
    script only execs it; made executable where a wheel left it without the bit), else
    one on PATH; None without either. For whoever starts a master (the tests, the
    benchmarks): a server only connects to one."""
    spec = importlib.util.find_spec("mooncake")
    for d in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(d, "mooncake_master")
        if os.path.isfile(path):
            if not os.access(path, os.X_OK):
                os.chmod(path, os.stat(path).st_mode | 0o111)
            return path
    return shutil.which("mooncake_master")


def _code(rc: int) -> str:
    return f"{rc} ({CODE_NAMES.get(rc, 'error')})"


def _split_address(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"mooncake backend: master must be host:port, got {addr!r}")
    return host, int(port)


class CallTimedOut(StorageUnavailable):
    """A store call took longer than op_timeout (it goes on, on its own thread)."""


class MooncakeClient:
    """A Mooncake store object (of `store_class`) set up against `settings["master"]`,
    with the bookkeeping every call needs: connecting (one setup at a time), probing a
    master that failed, bumping `generation` when it answers again, bounding calls by
    op_timeout, and the `counters` (named by the caller; "errors" and "connects" are
    counted here)."""

    def __init__(self, settings: dict, store_class, counters) -> None:
        self.settings = settings
        self.master = settings["master"]
        self._host_port = _split_address(self.master)
        self._cls = store_class
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
        self.counters = dict.fromkeys(counters, 0)
        try:
            self.connect()
        except StorageUnavailable as e:  # said by the start-up's probe (backends.open_backend), not here
            log.debug("%s; L3 calls fail until it answers", e)

    def count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self.counters[k] += v

    def snapshot(self) -> tuple[dict, bool]:
        """The counters, and whether the client is connected, read together."""
        with self._lock:
            return dict(self.counters), self._store is not None and not self._suspect

    def unavailable(self, what: str) -> StorageUnavailable:
        """Count one error, remember to probe before the next call, and build the
        exception (naming the master) for the caller to raise."""
        with self._lock:
            self.counters["errors"] += 1
            self._suspect = True
        return StorageUnavailable(f"mooncake backend: master {self.master} {what}")

    def check_rc(self, rc: int, what: str) -> None:
        """A code saying the master was not reached is StorageUnavailable; others are
        the caller's to judge."""
        if rc in UNAVAILABLE:
            raise self.unavailable(f"did not answer {what}: {_code(rc)}")

    def _probe(self) -> None:
        try:
            with socket.create_connection(self._host_port, timeout=self.settings["connect_timeout"]):
                pass
        except OSError as e:
            raise self.unavailable(f"is unreachable: {e}") from e

    def connect(self) -> None:
        """Set up a Mooncake client against the master (probing it first)."""
        self._probe()
        s = self.settings
        store = self._cls()
        try:
            rc = self.call(store.setup, s["local_hostname"], s["te_meta_data_server"], s["global_segment_size"],
                           s["local_buffer_size"], s["protocol"], s["device"], self.master,
                           abandoned=lambda: _close_quietly(store))
        except CallTimedOut:
            raise   # closed when the setup returns
        except StorageUnavailable:
            _close_quietly(store)
            raise
        except (TypeError, ValueError) as e:
            _close_quietly(store)
            raise self.unavailable(f"client setup failed: {e}") from e
        if rc != OK:
            _close_quietly(store)
            raise self.unavailable(f"refused the client setup (setup returned {_code(rc)}; "
                                   f"is a mooncake_master listening there?)")
        with self._lock:
            self._store = store
            self._suspect = False
            self.generation += bool(self.counters["connects"])
            self.counters["connects"] += 1

    @contextlib.contextmanager
    def store(self):
        """One operation: the connected store, or StorageUnavailable. close() waits for
        the operations in flight."""
        with self._lock:
            if self._closed:
                raise StorageUnavailable(f"mooncake backend (master {self.master}) is closed")
            self._inflight += 1
        try:
            if self._store is None:
                if not self._connect_lock.acquire(blocking=False):
                    raise self.unavailable("is not connected yet (another call is connecting)")
                try:
                    if self._store is None:
                        self.connect()
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

    def call(self, fn, *args, abandoned=None):
        """A store call, on a daemon thread, waited for at most op_timeout (CallTimedOut
        past it; `abandoned()` runs once the call returns after all). An exception from
        the binding is the store failing."""
        name = getattr(fn, "__name__", fn)
        with self._lock:
            hung = self._hung
        if hung >= MAX_HUNG:
            raise self.unavailable(f"has {hung} calls that did not return within op_timeout "
                                   f"({self.settings['op_timeout']:g} s)")
        fut = self._calls.submit(fn, *args)
        try:
            return fut.result(timeout=self.settings["op_timeout"])
        except (RuntimeError, OSError) as e:   # TimeoutError is an OSError: told apart by done()
            if fut.done():
                raise self.unavailable(f"call {name} failed: {e}") from e
        if not fut.cancel():   # it runs on: counted until it returns
            with self._lock:
                self._hung += 1
            fut.add_done_callback(lambda _: self._returned(abandoned))
        with self._lock:
            self.counters["errors"] += 1
            self._suspect = True
        raise CallTimedOut(f"mooncake backend: master {self.master} did not answer {name} within "
                           f"op_timeout ({self.settings['op_timeout']:g} s)")

    def call_batch(self, fn, names: list[str], what: str) -> list:
        """A batch call that must answer every name: a short answer is the master
        failing (StorageUnavailable, "answered 3 of 4 <what>")."""
        answers = self.call(fn, names)
        if len(answers) != len(names):
            raise self.unavailable(f"answered {len(answers)} of {len(names)} {what}")
        return answers

    def _returned(self, abandoned) -> None:
        """A call abandoned past op_timeout has returned."""
        with self._lock:
            self._hung -= 1
            self._idle.notify_all()
        if abandoned is not None:
            abandoned()

    def close(self) -> bool:
        """Wait for the calls in flight (each ends within op_timeout: returned, or given
        up and left running), then close the client (its segment, and the objects the
        master placed there, leave the store). Calls given up already are not waited
        for: they may never return. False if it was closed already."""
        with self._lock:
            if self._closed:
                return False
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
        return True


def _close_quietly(store) -> None:
    try:
        store.close()
    except Exception as e:  # noqa: BLE001 - closing must not raise
        log.debug("mooncake backend: close: %s", e)
