"""SGLang's gateway (`smg launch`, the PyPI package smg, a test dependency) in front of
`uniradix serve` workers, for the tests and the fleet benchmark: on 127.0.0.1 at a free
port (its Prometheus port too), stopped by its PID."""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time

from server_proc import HANG_S, ServerProc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "hicache"))
from service_process import free_port  # noqa: E402  (re-exported: the fleet benchmark takes it from here)


def smg_binary() -> str | None:
    return shutil.which("smg")


class GatewayProc(ServerProc):
    """`smg launch --policy POLICY --worker-urls URL...` with `flags` added; ready once it
    reports every worker healthy. Talked to with ServerProc's HTTP helpers."""

    name = "smg"

    def __init__(self, worker_urls: list[str], policy: str = "cache_aware", *flags: str,
                 startup_s: float = HANG_S) -> None:
        binary = smg_binary()
        if binary is None:
            raise RuntimeError("smg is not installed (pip install smg: a test dependency)")
        self.port = free_port()
        self.lines: list[str] = []
        fd, self.log_path = tempfile.mkstemp(prefix="uniradix-smg-", suffix=".log")
        os.close(fd)
        cmd = [binary, "launch", "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
               "--worker-urls", *worker_urls, "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--log-level", "warn", *flags]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self._reader = None
        atexit.register(self._kill_if_alive)   # a test that fails before stop() leaves no gateway behind
        deadline = time.monotonic() + startup_s
        while True:
            try:
                status, body, _ = self.get("/readiness")
                if status == 200 and isinstance(body, dict) and body.get("healthy_workers") == len(worker_urls):
                    break
            except Exception:   # not listening yet, or a partial answer
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                printed = self.log()
                self.stop()
                raise RuntimeError(f"smg did not become ready: {printed[-3000:]}")
            time.sleep(0.2)

    def log(self) -> str:
        """What smg printed (until stop, which removes it)."""
        try:
            with open(self.log_path) as f:
                return f.read()
        except OSError:
            return ""

    def workers(self) -> list[dict]:
        status, body, _ = self.get("/workers")
        assert status == 200, body
        return body["workers"]

    def stop(self, timeout: float = HANG_S) -> int:
        try:
            return super().stop(timeout)
        finally:
            self._log.close()
            if os.path.exists(self.log_path):
                os.unlink(self.log_path)

    def routed(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, str]:
        """POST through the gateway: (status, body, the worker URL it went to)."""
        status, out, h = self.post(path, body, headers=headers)
        return status, out, {k.lower(): v for k, v in h.items()}.get("x-smg-routed-worker-id", "")
