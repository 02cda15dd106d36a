"""Open sessions, their idle deadlines, and the turns SGLang's session continuation
builds on. A session's cache references live in the tree (register_session on each
finished turn); this knows when to drop them, and each recorded turn's tokens (prompt
and output), by the request id the client continues from."""
from __future__ import annotations

import time
import uuid
from collections import OrderedDict

#: turns kept per session for continuation (the oldest go first)
MAX_TURNS = 1024


class Sessions:
    """session id -> idle timeout (None: none) and last use; requests in flight keep a
    session open however long they run. Used on the scheduler thread only."""

    def __init__(self, default_timeout: float | None = None) -> None:
        self.default_timeout = default_timeout
        self._timeout: dict = {}
        self._last: dict = {}
        self._active: dict = {}
        self._turns: dict = {}    # sid -> OrderedDict rid -> (prompt ids, output ids), newest last

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
        self._turns.pop(sid, None)
        return self._timeout.pop(sid, False) is not False

    # ------------------------------------------------------------------ continuation
    def record(self, sid, rid: str, prompt, output) -> None:
        """A finished turn of an open session, continued from by its request id."""
        if sid not in self._timeout:
            return  # closed meanwhile
        turns = self._turns.setdefault(sid, OrderedDict())
        turns.pop(rid, None)
        turns[rid] = (tuple(prompt), tuple(output))
        while len(turns) > MAX_TURNS:
            turns.popitem(last=False)

    def context(self, sid, rid: str | None, offset: int | None, drop_output: bool) -> list[int]:
        """The tokens a continuation builds on: turn `rid` of session `sid` (None: its
        latest; none yet: nothing), its prompt and, unless `drop_output`, its output, cut
        at `offset`. ValueError names what is missing."""
        turns = self._turns.get(sid) or OrderedDict()
        if rid is None:
            if not turns:
                return []
            rid = next(reversed(turns))
        elif rid not in turns:
            raise ValueError(f"session_params.rid: session {sid!r:.60} has no finished request {rid!r:.60}")
        prompt, output = turns[rid]
        ctx = list(prompt) if drop_output else list(prompt) + list(output)
        if offset is not None:
            if offset > len(ctx):
                raise ValueError(f"session_params.offset {offset} is past the {len(ctx)} tokens of request {rid!r:.60}")
            ctx = ctx[:offset]
        return ctx

    def expired(self, now: float | None = None) -> list:
        """Idle sessions past their timeout (closing them is the caller's)."""
        now = time.monotonic() if now is None else now
        return [s for s, t in self._timeout.items()
                if t is not None and not self._active[s] and now - self._last[s] >= t]

    def next_deadline(self) -> float | None:
        ds = [self._last[s] + t for s, t in self._timeout.items() if t is not None and not self._active[s]]
        return min(ds, default=None)
