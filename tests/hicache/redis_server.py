"""A real redis-server for tests: on 127.0.0.1 at a free port, no persistence, in a
temporary directory, stopped by its PID at the end.

    with redis_url() as url: ...          # yields the URL
    with redis_server() as srv:           # srv.url, srv.port, srv.pid, srv.cli(...)
        ...
    with redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction"): ...

`start_redis(...)` gives the same `RedisServer` for fixtures that stop it themselves
(`srv.stop()`; `srv.restart()` starts it again on the same port). Without redis-server
on PATH the test is skipped ("apt-get install redis-server"), except when the CI
environment variable is set: there the test fails, since CI must have it.
"""
from __future__ import annotations

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
START_TIMEOUT = 10.0


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail("redis-server is not on PATH; CI must install it (apt-get install redis-server)",
                    pytrace=False)
    pytest.skip("redis-server not found: apt-get install redis-server")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _ping(port: int, timeout: float = 0.5) -> bool:
    """True when a server on the port answers PING with PONG (plain RESP, no client
    library, so the helper works without redis-py)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, *args: str, port: int | None = None) -> None:
        self.binary = redis_server_binary()
        self.args = list(args)
        self.fixed_port = port is not None
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="uniradix-redis-")
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.dir, "redis.log")

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> RedisServer:
        for attempt in range(3):
            try:
                return self._start()
            except RuntimeError:
                # a free port can be taken between choosing it and binding it
                if self.fixed_port or attempt == 2 or self._port_free():
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _port_free(self) -> bool:
        """True when nothing else holds the port (so a failed start was not a clash)."""
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((HOST, self.port))
            return True
        except OSError:
            return False

    def _start(self) -> RedisServer:
        cmd = [self.binary, "--port", str(self.port), "--bind", HOST, "--save", "",
               "--appendonly", "no", "--dir", self.dir, "--logfile", self.log_path,
               "--daemonize", "no", "--protected-mode", "yes", *self.args]
        self.proc = subprocess.Popen(cmd, cwd=self.dir, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                self.proc = None
                raise RuntimeError(f"redis-server on port {self.port} exited at start: "
                                   f"{err.strip()} {self._log_tail()}")
            if _ping(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within "
                           f"{START_TIMEOUT:.0f} s {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            with open(self.log_path) as fh:
                return "log: " + " | ".join(fh.read().splitlines()[-5:])
        except OSError:
            return ""

    def stop(self, kill: bool = False) -> None:
        """Stop the server this object started, by its PID: SIGTERM (SIGKILL at once
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
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        if proc.stderr:
            proc.stderr.close()

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def cli(self, *command: str | int | bytes, timeout: float = 5.0) -> bytes:
        """Send one command (plain RESP) and return the raw reply's first line/bytes."""
        parts = [c if isinstance(c, bytes) else str(c).encode() for c in command]
        msg = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        with socket.create_connection((HOST, self.port), timeout=timeout) as s:
            s.sendall(msg)
            return s.recv(65536)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_redis(*args: str, port: int | None = None) -> RedisServer:
    """A started server; the caller calls `.cleanup()` (stop and remove its directory)."""
    return RedisServer(*args, port=port).start()


@contextlib.contextmanager
def redis_url(*args: str, port: int | None = None):
    """Start a redis-server (extra args go on its command line), yield its URL, stop it.
    For a fixture: `with redis_url() as url: yield url`."""
    with redis_server(*args, port=port) as srv:
        yield srv.url


@contextlib.contextmanager
def redis_server(*args: str, port: int | None = None):
    """Start a redis-server (extra args go on its command line), yield the
    `RedisServer` (`.url`, `.port`, `.pid`, `.stop()`, `.restart()`, `.cli()`), stop it."""
    srv = RedisServer(*args, port=port)
    try:
        srv.start()
        yield srv
    finally:
        srv.cleanup()
