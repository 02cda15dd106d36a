"""A real redis-server for tests: on 127.0.0.1 at a free port, no persistence, in a
temporary directory, stopped by its PID at the end (see service_process.py).

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
import socket

from service_process import HOST, ServiceProcess, free_port  # noqa: F401 - free_port: re-exported

START_TIMEOUT = 120.0   # a guard against a hang only (a loaded machine starts it slowly)


def _ping(port: int, timeout: float = 0.5) -> bool:
    """True when a server on the port answers PING with PONG (plain RESP, no client
    library, so the helper works without redis-py)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer(ServiceProcess):
    name = "redis-server"
    install = "apt-get install redis-server"
    tag = "redis"
    log_name = "redis.log"
    start_timeout = START_TIMEOUT
    not_ready = "did not answer PING"

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def command(self) -> list[str]:
        # no --logfile: it logs to stdout, which goes to log_path
        return [self.binary, "--port", str(self.port), "--bind", HOST, "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--daemonize", "no",
                "--protected-mode", "yes", *self.args]

    def ready(self) -> bool:
        return _ping(self.port)

    def cli(self, *command: str | int | bytes, timeout: float = 5.0) -> bytes:
        """Send one command (plain RESP) and return the raw reply's first line/bytes."""
        parts = [c if isinstance(c, bytes) else str(c).encode() for c in command]
        msg = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        with socket.create_connection((HOST, self.port), timeout=timeout) as s:
            s.sendall(msg)
            return s.recv(65536)


def redis_server_binary() -> str:
    """The redis-server executable, or skip/fail saying what to install."""
    return RedisServer.find_binary()


def start_redis(*args: str, port: int | None = None) -> RedisServer:
    """A started server; the caller calls `.cleanup()` (stop and remove its directory)."""
    return RedisServer(*args, port=port).start()


def redis_server(*args: str, port: int | None = None):
    """Start a redis-server (extra args go on its command line), yield the
    `RedisServer` (`.url`, `.port`, `.pid`, `.stop()`, `.restart()`, `.cli()`), stop it."""
    return RedisServer.running(*args, port=port)


@contextlib.contextmanager
def redis_url(*args: str, port: int | None = None):
    """Start a redis-server (extra args go on its command line), yield its URL, stop it.
    For a fixture: `with redis_url() as url: yield url`."""
    with redis_server(*args, port=port) as srv:
        yield srv.url
