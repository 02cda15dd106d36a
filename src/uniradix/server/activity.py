"""What the server says while it works: one line per finished request when asked
(`--log-requests`), and while busy, a line every `--log-interval` seconds like SGLang's
batch lines: running and waiting requests, the new and cached prompt tokens admitted
since the last line, decode throughput, and each component's pool in use. Both are
built from the engine's own counters and the request's metrics, on the scheduler
thread."""
from __future__ import annotations

import logging
import time

from .request_log import record

log = logging.getLogger("uniradix.server")


def request_line(req, client_id: str | None = None) -> str:
    """One finished request: its id (the client's where it gave one, else the engine's),
    how it ended, its tokens (cached ones split by tier), TTFT and latency: the figures
    of its --request-log record."""
    r = record(req, client_id)
    ms = lambda v: "-" if v is None else f"{v * 1e3:.0f} ms"  # noqa: E731
    line = (f"request {r['rid']}: {r['status']} ({r['finish_reason'] or '-'}), prompt {r['prompt_tokens']} tokens, "
            f"cached {r['cached_tokens']} (device {r['cached_device']}, host {r['cached_host']}, storage "
            f"{r['cached_storage']}), computed {r['computed_tokens']}, output {r['output_tokens']}, "
            f"TTFT {ms(r['ttft'])}, latency {ms(r['latency'])}")
    if req.error:
        line += f", error: {req.error}"
    return line


class ActivityLog:
    """The periodic busy line: said at most every `interval` seconds (None: never),
    and only when something ran since the last one."""

    def __init__(self, engine, interval: float | None) -> None:
        self.engine = engine
        self.interval = interval
        self._last = time.monotonic()
        self._seen = self._counts()

    def _counts(self) -> dict:
        c = self.engine.counters
        return {k: c.get(k, 0) for k in ("prompt_tokens", "cached_tokens", "decode_tokens", "prefill_tokens",
                                         "steps")}

    def tick(self) -> None:
        if self.interval is None:
            return
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        counts = self._counts()
        delta = {k: counts[k] - self._seen[k] for k in counts}
        elapsed, self._last, self._seen = now - self._last, now, counts
        if not delta["steps"]:
            return
        log.info("%s", self.line(delta, elapsed))

    def line(self, delta: dict, elapsed: float) -> str:
        eng = self.engine
        new = delta["prompt_tokens"] - delta["cached_tokens"]
        usage = []
        for name, comp in eng.cache.stats()["components"].items():
            size, free = comp.get("pool_size"), comp.get("pool_available")
            if size:
                usage.append(f"{name} {100 * (size - free) / size:.0f}%")
        return (f"activity, last {elapsed:.0f} s: prompts {new} new + {delta['cached_tokens']} cached tokens, "
                f"{delta['prefill_tokens']} prefilled, decode {delta['decode_tokens'] / elapsed:.1f} tok/s; now "
                f"{len(eng.running)} running, {len(eng.waiting)} waiting; pools in use: {', '.join(usage) or '-'}")
