"""Rate-limited failure warnings for the L3 backends. A store that refuses every write
(read-only, full) fails once per key: a line per key buries the log, while the count
belongs in the backend's stats(). So the first failure of each kind is logged with its
reason, later ones are only counted, and one summary line per `interval` says how many
more failed (and the latest reason); `flush()` (the backend's close()) logs what is
still unreported."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

DEFAULT_INTERVAL_S = 30.0


@dataclass
class _Kind:
    last_line: float          # clock when a line for this kind was last logged
    pending: int = 0          # failures since that line, not yet reported
    latest: tuple = field(default_factory=tuple)   # (msg, args) of the latest failure


class LogLimiter:
    """`source` starts every line ("file backend"). `kind` names what failed, as a plural
    noun phrase the summary can count ("failed sets"). `clock` (seconds, monotonic) is
    injectable so that tests need not sleep."""

    def __init__(self, logger: logging.Logger, source: str, interval: float = DEFAULT_INTERVAL_S,
                 clock=time.monotonic, level: int = logging.WARNING) -> None:
        self.logger, self.source, self.interval = logger, source, interval
        self.clock, self.level = clock, level
        self._kinds: dict[str, _Kind] = {}
        self._lock = threading.Lock()

    def failure(self, kind: str, msg: str, *args, count: int = 1) -> None:
        """`count` failures of `kind`, for the reason `msg % args` (logging style: only
        formatted when a line is written). Never raises."""
        with self._lock:
            now = self.clock()
            k = self._kinds.get(kind)
            if k is None:   # the first of its kind: the reason, in full
                self._kinds[kind] = _Kind(last_line=now)
                line = ("%s: %s", (self.source, _reason(msg, args)))
            else:
                k.pending += count
                k.latest = (msg, args)
                if now - k.last_line < self.interval:
                    return
                line = self._summary(kind, k, now)
        self.logger.log(self.level, line[0], *line[1])

    def flush(self) -> None:
        """Log a summary for every kind with failures not yet reported."""
        with self._lock:
            now = self.clock()
            lines = [self._summary(kind, k, now) for kind, k in self._kinds.items() if k.pending]
        for msg, args in lines:
            self.logger.log(self.level, msg, *args)

    def pending(self, kind: str) -> int:
        """Failures of `kind` counted but not yet reported."""
        with self._lock:
            k = self._kinds.get(kind)
            return k.pending if k else 0

    def _summary(self, kind: str, k: _Kind, now: float) -> tuple[str, tuple]:
        line = ("%s: %d more %s in the last %.0f s (latest: %s)",
                (self.source, k.pending, kind, now - k.last_line, _reason(*k.latest)))
        k.pending, k.last_line = 0, now
        return line


def _reason(msg: str, args: tuple) -> str:
    try:
        return msg % args if args else msg
    except (TypeError, ValueError):
        return f"{msg} {args}"
