"""`--request-log PATH`: one JSON line per finished request, for `uniradix hit-rate` and
for an operator's own analysis: when it finished, its ids, how it ended, its prompt
tokens and the cached ones by tier, what was computed and generated, TTFT and latency.
No prompt or output text. Lines are written by a thread of their own (a slow disk
never holds the scheduler), appended, one complete line per write."""
from __future__ import annotations

import json
import logging
import queue
import threading
import time

log = logging.getLogger("uniradix.server")


def record(req, client_id: str | None) -> dict:
    m = req.metrics
    return {"time": round(time.time(), 3), "rid": client_id if client_id is not None else req.rid,
            "session": req.session_id, "status": req.status, "finish_reason": req.finish_reason,
            "prompt_tokens": m.prompt_tokens, "cached_tokens": m.cached_tokens,
            "cached_device": m.cached_tokens - m.host_tokens - m.storage_tokens, "cached_host": m.host_tokens,
            "cached_storage": m.storage_tokens, "computed_tokens": m.computed_tokens,
            "output_tokens": m.output_tokens, "ttft": None if m.ttft is None else round(m.ttft, 6),
            "latency": None if m.latency is None else round(m.latency, 6)}


class RequestLog:
    """The writer: `write(req, client_id)` from the scheduler thread, `close()` at the
    end (what was queued is written first)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # fails at start-up, naming the path, if it cannot
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="uniradix-request-log", daemon=True)
        self._thread.start()

    def write(self, req, client_id: str | None) -> None:
        self._queue.put(record(req, client_id))

    def _run(self) -> None:
        failed = False
        while True:
            item = self._queue.get()
            if item is None:
                break
            try:
                self._file.write(json.dumps(item, default=str) + "\n")
                if self._queue.empty():
                    self._file.flush()
            except OSError as e:
                if not failed:  # once: the log is an aid, never a reason to stop serving
                    log.warning("--request-log %s: writing failed (%s); further lines are dropped", self.path, e)
                failed = True

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        try:
            self._file.close()
        except OSError:
            pass
