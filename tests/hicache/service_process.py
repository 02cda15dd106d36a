"""A server process for tests (redis-server, mooncake_master): on 127.0.0.1 at a free
port, in its own temporary directory with its output in a log file there, stopped by
its PID at the end.

A subclass names the service and gives two hooks: `command()`, its command line, and
`ready()`, whether it answers yet; `find_binary()` finds the executable (or calls
`missing`). `ServiceProcess.running(...)` is the context manager that starts one,
yields it and cleans it up; `start()`, `stop(kill=...)`, `restart()`, `cleanup()` are
for fixtures that manage it themselves.

A missing binary or library skips the test, saying what to install, except when the
CI environment variable is set: there the test fails, since CI must have it.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

HOST = "127.0.0.1"


def missing(what: str):
    """Skip the test for a missing dependency `what` (say how to install it), or fail
    it when CI is set."""
    if os.environ.get("CI"):
        pytest.fail(f"{what}; CI must have it", pytrace=False)
    pytest.skip(what)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """True when nothing holds the port on HOST."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, port))
        return True
    except OSError:
        return False


# Every process still running when the test run ends is killed then (and its directory
# removed), even if no fixture got to it (an interrupted run).
_live: set[ServiceProcess] = set()


@atexit.register
def _stop_leftovers() -> None:
    for srv in list(_live):
        srv.stop(kill=True)
        shutil.rmtree(srv.dir, ignore_errors=True)


class ServiceProcess:
    name = "service"          # the executable's name, for messages
    install = "install it"    # how to get it, for the skip message
    tag = "service"           # in the temporary directory's name
    log_name = "service.log"
    # guards against a hang only: a loaded machine starts and stops a process slowly
    start_timeout = 120.0     # seconds until it must be ready
    stop_timeout = 60.0       # seconds to wait after SIGTERM (and after SIGKILL)
    log_lines = 5             # lines of log in an error message
    not_ready = "did not become ready"

    def __init__(self, *args: str, port: int | None = None) -> None:
        self.binary = self.find_binary()
        self.args = list(args)
        self.fixed_port = port is not None
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix=f"uniradix-{self.tag}-")
        self.log_path = os.path.join(self.dir, self.log_name)
        self.proc: subprocess.Popen | None = None

    # ------------------------------------------------------------------ hooks
    @classmethod
    def find_binary(cls) -> str:
        path = shutil.which(cls.name)
        if path:
            return path
        missing(f"{cls.name} not found: {cls.install}")
        raise AssertionError("unreachable")

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def ports(self) -> tuple[int, ...]:
        """The ports the process binds (all must be free for a start)."""
        return (self.port,)

    def choose_ports(self) -> None:
        self.port = free_port()

    # ------------------------------------------------------------------ life
    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self):
        for attempt in range(3):
            try:
                return self._start()
            except RuntimeError:
                # a free port can be taken between choosing it and binding it
                if self.fixed_port or attempt == 2 or all(map(port_free, self.ports())):
                    raise
                self.choose_ports()
        raise AssertionError("unreachable")

    def _start(self):
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), cwd=self.dir, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
        _live.add(self)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc, self.proc = self.proc.returncode, None
                _live.discard(self)
                raise RuntimeError(f"{self.name} on port {self.port} exited at start "
                                   f"(rc {rc}): {self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.name} on port {self.port} {self.not_ready} within "
                           f"{self.start_timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int | None = None) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "log: " + " | ".join(fh.read().splitlines()[-(lines or self.log_lines):])
        except OSError:
            return ""

    def stop(self, kill: bool = False) -> None:
        """Stop the process this object started, by its PID: SIGTERM (SIGKILL at once
        when `kill`), wait, SIGKILL if it lingers."""
        proc, self.proc = self.proc, None
        _live.discard(self)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.kill(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=self.stop_timeout)

    def restart(self):
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    @classmethod
    @contextlib.contextmanager
    def running(cls, *args: str, port: int | None = None):
        """Start one (extra args go on its command line), yield it, stop it and remove
        its directory."""
        srv = cls(*args, port=port)
        try:
            srv.start()
            yield srv
        finally:
            srv.cleanup()
