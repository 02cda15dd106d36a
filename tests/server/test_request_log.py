"""--request-log: a regular file only (a FIFO, a device or a directory is refused at
start-up, and the check itself cannot block); a sink that stops taking lines holds
neither requests nor shutdown (a bounded queue, lines past it dropped, counted in
/metrics and said once); the file is reopened on SIGHUP and when its path is moved or
removed (what logrotate does), and a removed file is closed. Every wait here only
catches a hang: no verdict depends on how fast anything is."""
from __future__ import annotations

import json
import logging
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from server_proc import ServerProc

from uniradix.server import request_log
from uniradix.server.request_log import RequestLog, open_sink

HERE = Path(__file__).resolve().parent
HANG_S = 120


def until(what, timeout: float = HANG_S, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {getattr(what, '__name__', what)}")
        time.sleep(poll)


def within(fn, timeout: float = HANG_S):
    """fn() on a thread of its own: its result, or a failure if it hangs."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} did not return within {timeout} s"
    return out[0] if out else None


def events(path: Path) -> list[str]:
    """The `event` (or `rid`) of each line at `path` ([] if there is no file)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [r.get("event", r.get("rid")) for r in map(json.loads, text.splitlines())]


def deleted_open(pid, path: Path) -> list[str]:
    """The descriptors of process `pid` still open on `path` after its removal."""
    fds = Path(f"/proc/{pid}/fd")
    out = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target == f"{path} (deleted)":
            out.append(target)
    return out


# ---------------------------------------------------------------------- the writer


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_only_a_regular_file_is_opened_and_the_check_never_blocks(tmp_path, kind):
    path = tmp_path / "log"
    if kind == "fifo":
        os.mkfifo(path)   # no reader: an open for writing that waits for one would hang here
    elif kind == "directory":
        path.mkdir()
    else:
        path = Path("/dev/null")

    def refused():
        with pytest.raises(ValueError) as e:
            open_sink(str(path))
        return str(e.value)
    msg = within(refused)
    assert str(path) in msg and "not a regular file" in msg and "\n" not in msg, msg
    os.close(within(lambda: open_sink(str(tmp_path / "new.jsonl"))))   # a regular file: created, opened
    assert (tmp_path / "new.jsonl").is_file()


def _fill(fd: int) -> None:
    """Fill a pipe nobody reads to the last byte, so the next write to it blocks for good."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    for chunk in (b"x" * 4096, b"x"):
        try:
            while True:
                os.write(fd, chunk)
        except BlockingIOError:
            pass
    fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def test_a_stuck_sink_holds_neither_the_writers_nor_close(tmp_path, monkeypatch, caplog):
    unread, stuck = os.pipe()   # nothing reads it: full, a write to it blocks for good
    _fill(stuck)
    monkeypatch.setattr(request_log, "open_sink", lambda path: os.dup(stuck))
    dropped = []
    log = RequestLog(str(tmp_path / "log.jsonl"), on_drop=dropped.append, queue_bytes=16 * 1024, check_s=3600)
    try:
        with caplog.at_level(logging.WARNING, logger="uniradix.server"):
            log.event("first")
            until(lambda: not log._pending)    # the writer took it and waits on the full pipe from now on
            line = lambda i: log.event("filler", pad="x" * 2000, n=f"{i:06d}")   # every line the same size
            # a few MB of lines against a full pipe and a 16 KiB queue: none of this may wait
            within(lambda: [line(i) for i in range(2000)])
            assert log.dropped > 0 and sum(dropped) == log.dropped
            assert 0 < log._pending_bytes <= log.queue_bytes
            assert log.dropped + len(log._pending) == 2000    # each line either queued or dropped, none lost
            before = log.dropped
            within(lambda: [line(i) for i in range(2000, 2100)])
            assert log.dropped == before + 100      # the queue is full and stays bounded: each new line goes
            assert sum(dropped) == log.dropped
            said = [r for r in caplog.records if "not keeping up" in r.getMessage()]
            assert len(said) == 1, [r.getMessage() for r in caplog.records]
            assert within(lambda: log.close(timeout=0.2)) is False   # left behind, not waited for
    finally:
        os.close(unread)   # the blocked write fails now (EPIPE) and the writer ends
        os.close(stuck)
    until(lambda: not log._thread.is_alive())


def test_lines_the_file_refuses_are_dropped_counted_and_said_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(request_log, "open_sink", lambda path: os.open("/dev/full", os.O_WRONLY))
    dropped = []
    log = RequestLog(str(tmp_path / "log.jsonl"), on_drop=dropped.append, check_s=3600)
    with caplog.at_level(logging.WARNING, logger="uniradix.server"):
        for i in range(5):
            log.event("x", n=i)
        assert within(lambda: log.close(timeout=HANG_S)) is True
    assert log.dropped == sum(dropped) == 5
    assert len([r for r in caplog.records if "writing failed" in r.getMessage()]) == 1


def test_a_moved_file_is_followed_by_a_new_one_at_the_path(tmp_path):
    path, moved = tmp_path / "log.jsonl", tmp_path / "log.jsonl.1"
    log = RequestLog(str(path), check_s=0.05)
    try:
        log.event("before")
        until(lambda: events(path) == ["before"])
        os.rename(path, moved)
        until(path.exists)           # reopened at the path
        log.event("after")
        until(lambda: events(path) == ["after"])
        assert events(moved) == ["before"]
    finally:
        assert log.close(HANG_S)


def test_a_removed_file_is_closed_and_a_new_one_opened(tmp_path):
    path = tmp_path / "log.jsonl"
    log = RequestLog(str(path), check_s=0.05)
    try:
        log.event("before")
        until(lambda: events(path) == ["before"])
        os.remove(path)
        until(lambda: path.exists() and not deleted_open(os.getpid(), path))   # its space is freed
        log.event("after")
        until(lambda: events(path) == ["after"])
    finally:
        assert log.close(HANG_S)


def test_reopen_alone_opens_the_path_again(tmp_path):
    """What SIGHUP asks, with the path check out of the way (once an hour)."""
    path, moved = tmp_path / "log.jsonl", tmp_path / "log.jsonl.1"
    log = RequestLog(str(path), check_s=3600)
    try:
        log.event("before")
        until(lambda: events(path) == ["before"])
        os.rename(path, moved)
        log.reopen()
        log.event("after")
        until(lambda: events(path) == ["after"])
        assert events(moved) == ["before"]
    finally:
        assert log.close(HANG_S)


# ---------------------------------------------------------------------- a server


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_the_server_refuses_a_log_that_is_not_a_regular_file(tmp_path, kind):
    path = tmp_path / "log"
    if kind == "fifo":
        os.mkfifo(path)   # the check opening it for writing would wait for a reader for good
    else:
        path.mkdir()
    out = subprocess.run([sys.executable, "-m", "uniradix.cli", "serve", "--port", "0", "--request-log",
                          str(path)], check=False, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"--request-log {path}" in out.stderr and "not a regular file" in out.stderr, out.stderr


def _generate(s: ServerProc, rid: str) -> None:
    status, out, _ = s.post("/generate", {"text": f"request {rid}", "rid": rid,
                                          "sampling_params": {"max_new_tokens": 1}})
    assert status == 200, out


def test_the_server_reopens_its_log_when_moved_removed_or_sent_sighup(tmp_path):
    path, moved = tmp_path / "requests.jsonl", tmp_path / "requests.jsonl.1"
    s = ServerProc("--max-total-tokens", "4096", "--request-log", str(path))
    try:
        _generate(s, "r1")
        until(lambda: "r1" in events(path))
        os.rename(path, moved)                               # logrotate without copytruncate
        until(path.exists)
        _generate(s, "r2")
        until(lambda: events(path) == ["r2"])
        assert events(moved) == ["start", "r1"]
        os.remove(path)
        until(lambda: path.exists() and not deleted_open(s.proc.pid, path))
        _generate(s, "r3")
        until(lambda: events(path) == ["r3"])
        os.kill(s.proc.pid, signal.SIGHUP)                   # logrotate's postrotate
        until(lambda: any("reopened (SIGHUP)" in line for line in s.lines))
        assert s.proc.poll() is None
        _generate(s, "r4")
        until(lambda: events(path) == ["r3", "r4"])
    finally:
        assert s.stop(HANG_S) == 0, "".join(s.lines[-30:])


def test_a_stuck_log_holds_neither_requests_nor_shutdown(tmp_path):
    """The sink is a pipe nobody reads (stuck_request_log/sitecustomize.py): every request
    is still answered, lines past the queue's bound are dropped and counted, the drop is
    said once, and SIGTERM ends the process (the writer is left behind)."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE / "stuck_request_log"),
                                                      os.environ.get("PYTHONPATH")) if p)}
    s = ServerProc("--max-total-tokens", "4096", "--request-log", str(tmp_path / "requests.jsonl"),
                   "--graceful-timeout", "2", env=env)
    key = "uniradix_request_log_lines_dropped_total"
    try:
        assert s.metrics()[key] == 0
        for i in range(200):      # the pipe takes a page, the queue about 8 records: the rest must drop
            _generate(s, f"r{i}")
            if s.metrics()[key] > 0:
                break
        before = s.metrics()[key]
        assert before > 0
        for i in range(20):
            _generate(s, f"more{i}")
        until(lambda: s.metrics()[key] >= before + 20)   # bounded: every further line is dropped, none held
        assert sum("not keeping up" in line for line in s.lines) == 1, "".join(s.lines[-30:])
    finally:
        code = s.stop(HANG_S)
    assert code == 0, "".join(s.lines[-30:])
    assert any("left behind" in line for line in s.lines), "".join(s.lines[-30:])
