"""The stores a benchmark starts for itself: a redis-server or a mooncake_master, on
127.0.0.1 at a free port, in a temporary directory (its output in a log file there),
stopped by its PID when the benchmark ends, however it ends (normally, on an error, on
Ctrl-C or SIGTERM: `running()` is a context manager, and an atexit hook stops what is
still running). Nothing listens beyond the loopback: Redis binds 127.0.0.1 with
protected mode on and no persistence; the Mooncake master binds its RPC and metrics
ports to 127.0.0.1 with no HTTP metadata server, and clients use P2PHANDSHAKE on
127.0.0.1.

    with running("redis") as srv: ...      # srv.url; srv.fresh() empties it
    with running("mooncake") as srv: ...   # srv.address; srv.lender mounts the memory

A benchmark-side copy of what tests/hicache/service_process.py does for the tests
(benchmarks import nothing from tests/).

Mooncake places objects in memory its clients lend (each mounts a segment): the
benchmark's own client (`lender`, prefix "lender:", lending `segment_size` bytes) holds
them for the whole run, so the engines' clients lend nothing (global_segment_size 0)
and what a pass wrote does not vanish when its engine closes; each pass writes under a
prefix of its own, cleared before and after it."""
from __future__ import annotations

import atexit
import contextlib
import ctypes.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

HOST = "127.0.0.1"
START_TIMEOUT_S = 120.0   # guards against a hang only (a loaded machine starts slowly)
STOP_TIMEOUT_S = 30.0
MOONCAKE_PIP = "mooncake-transfer-engine-non-cuda"
#: the master's settings (those of the tests): no HTTP metadata server, no metric reports,
#: eviction from 90% of the lent memory, a read lease of 1 s
MOONCAKE_FLAGS = ("--enable_http_metadata_server=false", "--http_metadata_server_host=" + HOST,
                  "--enable_metric_reporting=false", "--rpc_thread_num=2",
                  "--eviction_high_watermark_ratio=0.9", "--eviction_ratio=0.1", "--default_kv_lease_ttl=1000")

_live: set = set()


@atexit.register
def _stop_leftovers() -> None:
    for srv in list(_live):
        srv.stop()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def mooncake_binary() -> str | None:
    """The mooncake_master inside the `mooncake` package (the console script only execs
    it), else one on PATH; None without it."""
    from uniradix.hicache.backends.mooncake_client import master_binary
    return master_binary()


def mooncake_missing() -> str | None:
    """What is missing for the Mooncake store (None: nothing)."""
    if mooncake_binary() is None:
        return f"mooncake_master not found: pip install {MOONCAKE_PIP}"
    if not ctypes.util.find_library("ibverbs"):
        return "libibverbs (needed by Mooncake even for TCP) not found: apt-get install libibverbs1"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"cannot import mooncake.store ({e}): pip install {MOONCAKE_PIP}"
    return None


class Service:
    """One server process we started; `stop()` ends it by its PID."""

    kind = "service"
    log_name = "service.log"

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix=f"uniradix-bench-{self.kind}-")
        self.log_path = os.path.join(self.dir, self.log_name)
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def choose_ports(self) -> None:
        self.port = free_port()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "Service":
        for attempt in range(3):   # a free port can be taken between choosing and binding it
            self.choose_ports()
            try:
                return self._start()
            except RuntimeError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _start(self) -> "Service":
        with open(self.log_path, "ab") as log:
            # its own session: a Ctrl-C at the terminal reaches the benchmark, which stops
            # the service itself after its engine closed
            self.proc = subprocess.Popen(self.command(), cwd=self.dir, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        _live.add(self)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc, self.proc = self.proc.returncode, None
                _live.discard(self)
                raise RuntimeError(f"{self.kind} on port {self.port} exited at start (rc {rc}): {self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.kind} on port {self.port} was not ready within {START_TIMEOUT_S:.0f} s: "
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "log: " + " | ".join(fh.read().splitlines()[-lines:])
        except OSError:
            return ""

    def close_clients(self) -> None:
        """Close what this object opened in-process (before the process stops)."""

    def stop(self) -> None:
        """SIGTERM by PID, wait, SIGKILL if it lingers; then remove its directory."""
        self.close_clients()
        proc, self.proc = self.proc, None
        _live.discard(self)
        if proc is not None and proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=STOP_TIMEOUT_S)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=STOP_TIMEOUT_S)
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisService(Service):
    kind = "redis"
    log_name = "redis.log"

    def __init__(self) -> None:
        self.binary = redis_binary()
        if self.binary is None:
            raise RuntimeError("redis-server not found: apt-get install redis-server")
        super().__init__()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def command(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--daemonize", "no", "--protected-mode", "yes"]

    def ready(self) -> bool:
        return _redis_ping(self.port)

    def fresh(self, prefix: str) -> dict:
        """Empty the server (FLUSHALL) and give the extra config of a backend writing
        under `prefix`."""
        import redis
        r = redis.Redis(host=HOST, port=self.port, socket_timeout=10)
        try:
            r.flushall()
        finally:
            r.close()
        return {"url": self.url, "prefix": prefix}

    def done(self, prefix: str) -> None:
        self.fresh(prefix)

    def used_bytes(self) -> int | None:
        import redis
        r = redis.Redis(host=HOST, port=self.port, socket_timeout=10)
        try:
            return int(r.info("memory")["used_memory"])
        finally:
            r.close()


class MooncakeService(Service):
    kind = "mooncake"
    log_name = "master.log"

    def __init__(self, segment_size: int, local_buffer_size: int) -> None:
        why = mooncake_missing()
        if why:
            raise RuntimeError(why)
        self.binary = mooncake_binary()
        self.segment_size, self.local_buffer_size = segment_size, local_buffer_size
        self.metrics_port = 0
        self.lender = None
        super().__init__()

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def choose_ports(self) -> None:
        self.port, self.metrics_port = free_port(), free_port()

    def command(self) -> list[str]:
        return [self.binary, f"--rpc_address={HOST}", f"--rpc_port={self.port}", f"--metrics_host={HOST}",
                f"--metrics_port={self.metrics_port}", *MOONCAKE_FLAGS]

    def ready(self) -> bool:
        return _accepts(self.port)

    def start(self) -> "MooncakeService":
        super().start()
        from uniradix.hicache.backends.mooncake import MooncakeBackend
        # the memory every pass's objects are placed in, lent for the whole run
        self.lender = MooncakeBackend({"master": self.address, "prefix": "lender:",
                                       "global_segment_size": self.segment_size, "local_buffer_size": 16 << 20,
                                       "local_hostname": HOST, "te_meta_data_server": "P2PHANDSHAKE",
                                       "protocol": "tcp"})
        self.lender.probe()
        return self

    def client_config(self, prefix: str, segment: int = 0) -> dict:
        return {"master": self.address, "prefix": prefix, "global_segment_size": segment,
                "local_buffer_size": self.local_buffer_size, "local_hostname": HOST,
                "te_meta_data_server": "P2PHANDSHAKE", "protocol": "tcp"}

    def _clear(self, prefix: str) -> None:
        from uniradix.hicache.backends.mooncake import MooncakeBackend
        b = MooncakeBackend(self.client_config(prefix))
        try:
            b.clear()
        finally:
            b.close()

    def fresh(self, prefix: str) -> dict:
        """Remove whatever is under `prefix` and give the extra config of a backend that
        writes there, lending no memory (the lender's holds the objects)."""
        self._clear(prefix)
        return self.client_config(prefix)

    def done(self, prefix: str) -> None:
        self._clear(prefix)   # the lent memory is the next pass's

    def used_bytes(self) -> int | None:
        return None

    def close_clients(self) -> None:
        lender, self.lender = self.lender, None
        if lender is not None:
            lender.close()


class FileStore:
    """The file backend in a fresh directory per pass (no process to start)."""

    kind = "file"

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="uniradix-bench-l3-")
        self.pid = None

    def start(self) -> "FileStore":
        return self

    def fresh(self, prefix: str) -> dict:
        path = os.path.join(self.dir, prefix.strip(":") or "store")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return {"path": path}

    def done(self, prefix: str) -> None:
        shutil.rmtree(os.path.join(self.dir, prefix.strip(":") or "store"), ignore_errors=True)

    def used_bytes(self) -> int | None:
        return None

    def stop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running(kind: str, *, segment_size: int = 2 << 30, local_buffer_size: int = 64 << 20):
    """Start the store `kind` names (file: a temporary directory), yield it, stop it
    (by PID) and remove its directory, also on an error or Ctrl-C. SIGTERM is turned
    into SystemExit while it runs, so that the same clean-up runs."""
    if kind == "redis":
        srv = RedisService()
    elif kind == "mooncake":
        srv = MooncakeService(segment_size, local_buffer_size)
    elif kind == "file":
        srv = FileStore()
    else:
        raise ValueError(f"unknown store {kind!r}: file, redis or mooncake")

    def terminated(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        srv.start()
        yield srv
    finally:
        try:
            srv.stop()
        finally:
            signal.signal(signal.SIGTERM, previous)
