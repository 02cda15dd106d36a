"""`--request-log PATH`: one JSON line per finished request, for `uniradix hit-rate` and
for an operator's own analysis: when it finished, its ids, how it ended, its prompt
tokens and the cached ones by tier, what was computed and generated, TTFT and latency.
No prompt or output text; with `--log-token-ids`, the prompt's and the output's token
ids, and what else decides reuse (a digest of the cache salt, the priority, where prompt
logprobs began), so that `uniradix simulate` can replay the traffic. Besides requests,
two events: `start` (the settings in force, once per server start) and `close_session`
(a session closed or expired: its cache references go).

The log is an aid, never a reason to stop or slow serving:
- it is a regular file, appended to (O_APPEND, one complete line per write); a FIFO, a
  device or a directory is refused at start-up, and neither that check nor any later
  open can block (`open_sink`);
- lines are written by a thread of its own from a bounded queue: a sink that stops
  taking lines (a stuck disk) never holds the scheduler, lines past the bound are
  dropped, counted (`on_drop`: uniradix_request_log_lines_dropped_total) and said once;
- the file is reopened on SIGHUP (`reopen`) and when the path no longer names the open
  file (moved or removed, as logrotate does), checked about every second, so a
  removed file's space is freed;
- `close` gives the writer a bounded time, then leaves it behind."""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import stat
import threading
import time

log = logging.getLogger("uniradix.server")

#: what the lines waiting for the writer may hold, in bytes (an estimate of the queued
#: records: token ids dominate); past it new lines are dropped and counted
QUEUE_BYTES = 16 << 20
#: seconds between checks that the path still names the open file
CHECK_S = 1.0


def record(req, client_id: str | None, token_ids: bool = False) -> dict:
    m = req.metrics
    out = {"time": round(time.time(), 6), "rid": client_id if client_id is not None else req.rid,
           "session": req.session_id, "status": req.status, "finish_reason": req.finish_reason,
           "prompt_tokens": m.prompt_tokens, "cached_tokens": m.cached_tokens,
           "cached_device": m.cached_tokens - m.host_tokens - m.storage_tokens, "cached_host": m.host_tokens,
           "cached_storage": m.storage_tokens, "cached_cross_instance": m.cross_instance_tokens,
           "computed_tokens": m.computed_tokens,
           "output_tokens": m.output_tokens, "ttft": None if m.ttft is None else round(m.ttft, 6),
           "latency": None if m.latency is None else round(m.latency, 6)}
    if m.spec_verify_ct:  # speculation: its verify steps, drafts and drafts kept (simulate reads none of it)
        out.update(spec_verify_ct=m.spec_verify_ct, spec_draft_tokens=m.spec_draft_tokens,
                   spec_accepted_tokens=m.spec_accepted_tokens)
    if token_ids:
        out.update(input_ids=list(req.input_ids or ()), output_ids=list(req.output_ids),
                   salt=salt_digest(req.salt), priority=req.priority,
                   prompt_logprobs_from=req.prompt_logprobs_from)
    return out


def salt_digest(salt) -> str | None:
    """A cache salt as the log shows it: a digest that keeps which requests share one
    (what a replay needs) and not the salt itself (a tenant's secret)."""
    from ..tree.keys import salt_key
    key = salt_key(salt)
    return None if key is None else hashlib.sha256(key.encode()).hexdigest()[:16]


def open_sink(path: str) -> int:
    """A descriptor appending to the regular file at `path` (created if absent), or a
    ValueError in one line naming the path and why not. The path is looked at before it
    is opened, and opened non-blocking, so that a FIFO without a reader (or one swapped
    in between) can never hold the caller; what was opened is checked again."""
    try:
        kind = _not_regular(os.stat(path).st_mode)
        if kind:
            raise ValueError(f"--request-log {path}: {kind}, not a regular file")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except FileNotFoundError:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise ValueError(f"--request-log {path}: {e.strerror or e}") from None
    except OSError as e:
        raise ValueError(f"--request-log {path}: {e.strerror or e}") from None
    try:
        kind = _not_regular(os.fstat(fd).st_mode)
        if kind:
            raise ValueError(f"--request-log {path}: {kind}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_path(path: str) -> None:
    """Start-up's check: the log can be opened (ValueError in one line if not)."""
    os.close(open_sink(path))


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a file"


def _footprint(item: dict) -> int:
    """About what a queued record holds in memory: its token ids dominate."""
    return 512 + 32 * sum(len(v) for v in item.values() if isinstance(v, (list, tuple)))


class RequestLog:
    """The writer: `write(req, client_id)` and `event(kind, ...)` from any thread (never
    blocking), `reopen()` from a signal handler, `close(timeout)` at the end (what was
    queued is written first, for at most `timeout` seconds). `token_ids`: log them
    (--log-token-ids). `on_drop(n)`: told of every `n` lines dropped. `queue_bytes`,
    `check_s`: the queue's bound and how often the path is checked (module defaults)."""

    def __init__(self, path: str, token_ids: bool = False, *, on_drop=None, queue_bytes: int | None = None,
                 check_s: float | None = None) -> None:
        self.path = path
        self.token_ids = token_ids
        self.on_drop = on_drop
        self.queue_bytes = QUEUE_BYTES if queue_bytes is None else queue_bytes
        self.check_s = CHECK_S if check_s is None else check_s
        self.dropped = 0                       # lines not written: the queue full, or the file refusing them
        self._fd = open_sink(path)             # ValueError at start-up, naming the path
        self._file_id = _file_id(os.fstat(self._fd))
        self._pending: collections.deque = collections.deque()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._closing = False
        self._reopen_asked = False             # set by a signal handler: no lock taken there
        self._said: set[str] = set()           # why lines were dropped, each said once
        self._reopen_failing = False           # a failed reopen is said once until one succeeds
        self._thread = threading.Thread(target=self._run, name="uniradix-request-log", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def write(self, req, client_id: str | None) -> None:
        self._put(record(req, client_id, self.token_ids))

    def event(self, kind: str, **fields) -> None:
        self._put({"time": round(time.time(), 6), "event": kind, **fields})

    def reopen(self) -> None:
        """Open the path again before the next line (SIGHUP: safe in a signal handler)."""
        self._reopen_asked = True

    def close(self, timeout: float = 5.0) -> bool:
        """Write what is queued and close the file, waiting at most `timeout` seconds;
        False if the writer was left behind (a sink that takes nothing more)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                left = len(self._pending)
            log.warning("--request-log %s: the file took no more lines within %.1f s of shutdown: the writer is "
                        "left behind, %d queued line(s) unwritten", self.path, timeout, left)
            return False
        return True

    def _put(self, item: dict) -> None:
        size = _footprint(item)
        with self._cond:
            if self._closing:
                return
            if self._pending and self._pending_bytes + size > self.queue_bytes:
                full = True
            else:
                full = False
                self._pending.append((item, size))
                self._pending_bytes += size
                self._cond.notify()
        if full:
            self._drop(1, "full", "--request-log %s: the file is not keeping up; lines past the queue's bound are "
                       "dropped (counted in uniradix_request_log_lines_dropped_total)", self.path)

    # ------------------------------------------------------------------ the writer thread
    def _run(self) -> None:
        next_check = time.monotonic() + self.check_s
        while True:
            with self._cond:
                while not (self._pending or self._closing or self._reopen_asked):
                    left = next_check - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                item = self._pending.popleft() if self._pending else None
                if item is not None:
                    self._pending_bytes -= item[1]
                done = item is None and self._closing
            if self._reopen_asked:
                self._reopen_asked = False
                self._reopen("SIGHUP")
            if time.monotonic() >= next_check:
                self._check_path()
                next_check = time.monotonic() + self.check_s
            if item is not None:
                self._write_line(item[0])
            if done:
                break
        os.close(self._fd)

    def _write_line(self, item: dict) -> None:
        try:
            data = memoryview((json.dumps(item, default=str) + "\n").encode())
            while data:
                data = data[os.write(self._fd, data):]
        except (OSError, ValueError, TypeError) as e:
            self._drop(1, "write", "--request-log %s: writing failed (%s); lines that cannot be written are "
                       "dropped (counted in uniradix_request_log_lines_dropped_total)", self.path, e)

    def _check_path(self) -> None:
        """Reopen when the path no longer names the open file (moved or removed)."""
        try:
            same = _file_id(os.stat(self.path)) == self._file_id
        except FileNotFoundError:
            same = False
        except OSError:
            return
        if not same:
            self._reopen("the path no longer names the open file")

    def _reopen(self, why: str) -> None:
        try:
            fd = open_sink(self.path)
        except ValueError as e:  # keep the open file; tried again at the next check
            if not self._reopen_failing:
                self._reopen_failing = True
                log.warning("%s: cannot reopen (%s); lines go on to the file open before", e, why)
            return
        self._reopen_failing = False
        os.close(self._fd)
        self._fd, self._file_id = fd, _file_id(os.fstat(fd))
        log.info("--request-log %s: reopened (%s)", self.path, why)

    def _drop(self, n: int, reason: str, *warning) -> None:
        with self._cond:
            self.dropped += n
            say = reason not in self._said
            self._said.add(reason)
        if self.on_drop is not None:
            self.on_drop(n)
        if say:
            log.warning(*warning)


def _file_id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino
