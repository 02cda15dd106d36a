"""`--request-log PATH`: one JSON line per finished request, for `uniradix hit-rate` and
for an operator's own analysis: when it finished, its ids, how it ended, its prompt
tokens and the cached ones by tier, what was computed and generated, TTFT and latency.
No prompt or output text; with `--log-token-ids`, the prompt's and the output's token
ids, and what else decides reuse (a digest of the cache salt, the priority, where prompt
logprobs began), so that `uniradix simulate` can replay the traffic. Besides requests,
two events: `start` (the settings in force, once per server start) and `close_session`
(a session closed or expired: its cache references go). Lines are written by a thread
of their own (a slow disk never holds the scheduler), appended, one complete line per
write."""
from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time

log = logging.getLogger("uniradix.server")


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


class RequestLog:
    """The writer: `write(req, client_id)` and `event(kind, ...)` from the scheduler
    thread, `close()` at the end (what was queued is written first). `token_ids`: log
    them (--log-token-ids)."""

    def __init__(self, path: str, token_ids: bool = False) -> None:
        self.path = path
        self.token_ids = token_ids
        self._file = open(path, "a", encoding="utf-8")  # fails at start-up, naming the path, if it cannot
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="uniradix-request-log", daemon=True)
        self._thread.start()

    def write(self, req, client_id: str | None) -> None:
        self._queue.put(record(req, client_id, self.token_ids))

    def event(self, kind: str, **fields) -> None:
        self._queue.put({"time": round(time.time(), 6), "event": kind, **fields})

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
