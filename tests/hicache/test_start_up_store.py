"""A store that cannot be reached at start-up stops the start: `uniradix serve` and
`uniradix run` exit 2 with one line naming it (its password masked), instead of serving
with L3 silently off, unless the extra config says "allow_unavailable_at_start": true;
then the server starts, counts the store's failures, and uses it once it answers (as
when a store goes away later)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis_server import free_port, redis_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
from server_proc import ServerProc  # noqa: E402

PASSWORD = "S3cretPw9"
HANG_S = 300   # a guard against a hang only: a start on a loaded machine takes far less


def start_up(command: str, backend: str, extra: dict, *flags: str) -> tuple[int | None, list[str]]:
    """Start `uniradix <command>` with the store; (exit status, output lines), or (None,
    lines) when it started serving (then it is stopped: the old behaviour)."""
    cmd = [sys.executable, "-m", "uniradix.cli", command, "--hicache-storage-backend", backend,
           "--hicache-storage-backend-extra-config", json.dumps(extra), *flags]
    cmd += ["--port", "0"] if command == "serve" else ["--no-progress", "--clients", "1", "--rounds", "1"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines, deadline = [], time.monotonic() + HANG_S
    try:
        for line in p.stdout:
            lines.append(line.rstrip("\n"))
            if command == "serve" and " on http://127.0.0.1:" in line:
                return None, lines
            assert time.monotonic() < deadline, "\n".join(lines[-20:])
        return p.wait(HANG_S), lines
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def one_line_naming(lines: list[str], where: str, command: str) -> str:
    naming = [line for line in lines if where in line]
    assert len(naming) == 1 and naming[0].startswith(f"uniradix {command}: "), lines
    assert "allow_unavailable_at_start" in naming[0]   # it says how to start anyway
    return naming[0]


@pytest.mark.parametrize("command", ["serve", "run"])
def test_an_unreachable_redis_stops_the_start(command):
    port = free_port()   # nothing listens there
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    code, lines = start_up(command, "redis", {"url": url, "socket_timeout": 1})
    assert code == 2, lines
    one_line_naming(lines, f"redis://:***@127.0.0.1:{port}/0", command)
    assert not any(PASSWORD in line for line in lines), lines


def test_an_unreachable_mooncake_master_stops_the_start():
    from backend_contract import MOONCAKE_SIZES
    from mooncake_master import require_mooncake
    require_mooncake()
    port = free_port()
    code, lines = start_up("serve", "mooncake", {"master": f"127.0.0.1:{port}", **MOONCAKE_SIZES})
    assert code == 2, lines
    one_line_naming(lines, f"127.0.0.1:{port}", "serve")


def test_a_file_store_that_cannot_be_a_directory_stops_the_start(tmp_path):
    (tmp_path / "f").write_text("a file, not a directory")
    code, lines = start_up("serve", "file", {"path": str(tmp_path / "f" / "l3")})
    assert code == 2, lines
    naming = [line for line in lines if str(tmp_path / "f" / "l3") in line]
    assert len(naming) == 1 and naming[0].startswith("uniradix serve: "), lines


def test_a_store_allowed_to_come_later_is_counted_then_used(tmp_path):
    port = free_port()
    extra = {"url": f"redis://127.0.0.1:{port}/0", "socket_timeout": 1, "prefetch_threshold": 1,
             "allow_unavailable_at_start": True}
    s = ServerProc("--page-size", "4", "--hicache-storage-backend", "redis",
                   "--hicache-storage-backend-extra-config", json.dumps(extra))
    try:
        assert any("L3 calls fail until it answers" in line and f"127.0.0.1:{port}" in line for line in s.lines)
        body = {"input_ids": [3 + i % 200 for i in range(40)], "sampling_params": {"max_new_tokens": 2}}
        code, out, _ = s.post("/generate", body)
        assert code == 200, out   # served without its store
        until(lambda: s.metrics()["uniradix_storage_errors_total"] > 0)   # and the store's failures counted
        with redis_server(port=port):   # the store comes: the next writes reach it
            more = {**body, "input_ids": [5 + i % 200 for i in range(40)]}
            until(lambda: s.post("/generate", more)[0] == 200
                  and s.metrics()["uniradix_storage_written_bytes_total"] > 0)
    finally:
        assert s.stop() == 0, "".join(s.lines[-30:])


def until(what, timeout: float = HANG_S, every: float = 0.2):
    """Wait for `what()` to hold; the timeout only catches a hang."""
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)
