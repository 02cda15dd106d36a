"""Open sessions and their idle deadlines. A session's cache references live in the
tree (register_session on each finished turn); this only knows when to drop them."""
from __future__ import annotations

import time
import uuid


class Sessions:
    """session id -> idle timeout (None: none) and last use; requests in flight keep a
    session open however long they run. Used on the scheduler thread only."""

    def __init__(self, default_timeout: float | None = None) -> None:
        self.default_timeout = default_timeout
        self._timeout: dict = {}
        self._last: dict = {}
        self._active: dict = {}

    def __len__(self) -> int:
        return len(self._timeout)

    def __contains__(self, sid) -> bool:
        return sid in self._timeout

    def open(self, sid=None, timeout: float | None = None) -> str:
        sid = uuid.uuid4().hex if sid is None else sid
        self._timeout[sid] = self.default_timeout if timeout is None else timeout
        self._last[sid] = time.monotonic()
        self._active.setdefault(sid, 0)
        return sid

    def begin(self, sid) -> None:
        """A request of the session starts (a session first seen here opens itself)."""
        if sid not in self._timeout:
            self.open(sid)
        self._active[sid] += 1
        self._last[sid] = time.monotonic()

    def end(self, sid) -> None:
        if sid in self._active:
            self._active[sid] = max(0, self._active[sid] - 1)
            self._last[sid] = time.monotonic()

    def close(self, sid) -> bool:
        self._last.pop(sid, None)
        self._active.pop(sid, None)
        return self._timeout.pop(sid, False) is not False

    def expired(self, now: float | None = None) -> list:
        """Idle sessions past their timeout (closing them is the caller's)."""
        now = time.monotonic() if now is None else now
        return [s for s, t in self._timeout.items()
                if t is not None and not self._active[s] and now - self._last[s] >= t]

    def next_deadline(self) -> float | None:
        ds = [self._last[s] + t for s, t in self._timeout.items() if t is not None and not self._active[s]]
        return min(ds, default=None)
