"""A `uniradix serve` process for the tests: started on 127.0.0.1 with a free port,
talked to over real HTTP, stopped by its PID (SIGTERM, then its exit status)."""
from __future__ import annotations

import atexit
import http.client
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time

#: the longest a test waits for anything a server does (a start, an answer, going idle,
#: a stop): a guard against a hang only. A loaded CI machine may be many times slower
#: than a quiet one, so no verdict hangs on a shorter budget (wait on events instead).
HANG_S = 600.0


class ServerProc:
    """`nofile`: the server's file descriptor limit (soft and hard)."""

    name = "uniradix serve"

    def __init__(self, *flags: str, env: dict | None = None, startup_s: float = HANG_S,
                 nofile: int | None = None, environ: dict | None = None, cwd=None) -> None:
        """`env`: added to this process's environment, with one compute thread; `environ`:
        the whole environment instead (a user's shell, as the docs' examples run)."""
        cmd = [sys.executable, "-m", "uniradix.cli", "serve", "--port", "0", *flags]
        e = environ if environ is not None else dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        limit = None if nofile is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
                                     preexec_fn=limit, cwd=cwd)
        self.lines: list[str] = []
        self.port = None
        deadline = time.monotonic() + startup_s
        while self.port is None:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("uniradix serve exited at start-up:\n" + "".join(self.lines[-30:]))
            self.lines.append(line)
            m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("uniradix serve did not start")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        atexit.register(self._kill_if_alive)  # a test that fails before stop() leaves no server behind

    def _kill_if_alive(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self, timeout: float = HANG_S) -> int:
        """SIGTERM by PID; the exit status (the process is killed if it hangs)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"{self.name} did not stop on SIGTERM")
        if self._reader is not None:
            self._reader.join(5)
        return self.proc.returncode

    # ------------------------------------------------------------------ HTTP
    def conn(self, timeout: float = HANG_S) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None):
        """(status, parsed JSON or text, headers)."""
        c = self.conn()
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            h = {"Content-Type": "application/json", **(headers or {})}
            c.request(method, path, body=data, headers=h)
            r = c.getresponse()
            text = r.read().decode()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = text
            return r.status, parsed, dict(r.getheaders())
        finally:
            c.close()

    def post(self, path: str, body=None, **kw):
        return self.request("POST", path, body, **kw)

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)

    def stream(self, path: str, body: dict, headers: dict | None = None):
        """The SSE events' data, parsed (the final "[DONE]" as the string)."""
        c = self.conn()
        try:
            c.request("POST", path, body=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json", **(headers or {})})
            r = c.getresponse()
            assert r.status == 200, (r.status, r.read())
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    d = line[6:]
                    yield d if d == "[DONE]" else json.loads(d)
        finally:
            c.close()

    def metrics(self) -> dict:
        """/metrics as {name{labels}: value} (no histogram buckets)."""
        status, text, _ = self.get("/metrics")
        assert status == 200
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "_bucket" not in line:
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def audit(self) -> dict:
        status, body, _ = self.get("/audit")
        assert status == 200, body
        return body

    def wait_idle(self, timeout: float = HANG_S) -> dict:
        """Poll /metrics until nothing runs or waits; returns the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["uniradix_running_requests"] == 0 and m["uniradix_waiting_requests"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not go idle: {m}")
            time.sleep(0.05)
