"""A real mooncake_master for tests: on 127.0.0.1 at a free port (its RPC port and its
admin/metrics HTTP port both bound to 127.0.0.1, no HTTP metadata server: clients use
P2PHANDSHAKE), in a temporary directory, stopped by its PID at the end.

    with master_address() as addr: ...     # yields "127.0.0.1:PORT"
    with master_server() as m:             # m.address, m.port, m.pid, m.stop(kill=True),
        ...                                #   m.start() again on the same port, m.log_tail()
    with master_server("--default_kv_lease_ttl=200"): ...   # extra flags

`start_master(...)` gives the same `MooncakeMaster` for fixtures that stop it
themselves (`m.cleanup()`). `require_mooncake()` checks that the Mooncake store can be
used at all: the mooncake_master binary, libibverbs, and `import mooncake.store`.
Without them the test is skipped, saying what to install, except when the CI
environment variable is set: there the test fails, since CI must have them.

The binary is the one inside the `mooncake` package (the `mooncake_master` console
script only execs it); the PID we hold is the master's own.
"""
from __future__ import annotations

import contextlib
import ctypes.util
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

HOST = "127.0.0.1"
START_TIMEOUT = 20.0
PIP_PACKAGE = "mooncake-transfer-engine-non-cuda"

# The master's settings for tests. Eviction: start at 90% of the mounted memory and
# drop 10% of the objects; a read lease of 1 s (the default is 10 s) so that eviction
# is not held up long by recent reads.
DEFAULT_FLAGS = (
    "--enable_http_metadata_server=false",
    "--http_metadata_server_host=" + HOST,
    "--enable_metric_reporting=false",
    "--rpc_thread_num=2",
    "--eviction_high_watermark_ratio=0.9",
    "--eviction_ratio=0.1",
    "--default_kv_lease_ttl=1000",
)


def _missing(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what}; CI must have it", pytrace=False)
    pytest.skip(what)


def master_binary() -> str:
    """The mooncake_master executable, or skip/fail saying what to install."""
    spec = importlib.util.find_spec("mooncake")
    for d in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(d, "mooncake_master")
        if os.path.isfile(path):
            if not os.access(path, os.X_OK):
                os.chmod(path, os.stat(path).st_mode | 0o111)
            return path
    path = shutil.which("mooncake_master")
    if path:
        return path
    _missing(f"mooncake_master not found: pip install {PIP_PACKAGE}")
    raise AssertionError("unreachable")


def require_mooncake() -> str:
    """Check the master binary, libibverbs and the Python client; return the binary."""
    binary = master_binary()
    if not ctypes.util.find_library("ibverbs"):
        _missing("libibverbs (needed by Mooncake even for TCP) not found: "
                 "apt-get install libibverbs1")
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        _missing(f"cannot import mooncake.store ({e}): pip install {PIP_PACKAGE}")
    return binary


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _accepts(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


class MooncakeMaster:
    def __init__(self, *flags: str, port: int | None = None) -> None:
        self.binary = require_mooncake()
        self.flags = list(flags)
        self.fixed_port = port is not None
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.dir = tempfile.mkdtemp(prefix="uniradix-mooncake-")
        self.log_path = os.path.join(self.dir, "master.log")
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> MooncakeMaster:
        for attempt in range(3):
            try:
                return self._start()
            except RuntimeError:
                # a free port can be taken between choosing it and binding it
                if self.fixed_port or attempt == 2 or (self._port_free(self.port)
                                                       and self._port_free(self.metrics_port)):
                    raise
                self.port, self.metrics_port = free_port(), free_port()
        raise AssertionError("unreachable")

    @staticmethod
    def _port_free(port: int) -> bool:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((HOST, port))
            return True
        except OSError:
            return False

    def _start(self) -> MooncakeMaster:
        cmd = [self.binary, f"--rpc_address={HOST}", f"--rpc_port={self.port}",
               f"--metrics_host={HOST}", f"--metrics_port={self.metrics_port}",
               *DEFAULT_FLAGS, *self.flags]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.dir, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc, self.proc = self.proc.returncode, None
                raise RuntimeError(f"mooncake_master on port {self.port} exited at start "
                                   f"(rc {rc}): {self.log_tail()}")
            if _accepts(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"mooncake_master on port {self.port} did not accept connections "
                           f"within {START_TIMEOUT:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 8) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "log: " + " | ".join(fh.read().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, kill: bool = False) -> None:
        """Stop the master this object started, by its PID: SIGTERM (SIGKILL at once
        when `kill`), wait, SIGKILL if it lingers."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def restart(self) -> MooncakeMaster:
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_master(*flags: str, port: int | None = None) -> MooncakeMaster:
    """A started master; the caller calls `.cleanup()` (stop it, remove its directory)."""
    return MooncakeMaster(*flags, port=port).start()


@contextlib.contextmanager
def master_server(*flags: str, port: int | None = None):
    """Start a mooncake_master (extra flags go on its command line), yield the
    `MooncakeMaster`, stop it."""
    m = MooncakeMaster(*flags, port=port)
    try:
        m.start()
        yield m
    finally:
        m.cleanup()


@contextlib.contextmanager
def master_address(*flags: str, port: int | None = None):
    """Start a mooncake_master, yield its address "127.0.0.1:PORT", stop it."""
    with master_server(*flags, port=port) as m:
        yield m.address
