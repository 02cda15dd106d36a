"""Open sessions, their idle deadlines, and the turns SGLang's session continuation
builds on. A session's cache references live in the tree (register_session on each
finished turn); this knows when to drop them, and each recorded turn's tokens (prompt
and output), by the request id the client continues from.

A session belongs to the tenant it was opened under (the cache salt and extra key, as
reuse partitions by them: tree.keys.session_key decides): every method takes the
asking request's salt, and from another salt a session does not exist. The same id
under two salts is two sessions, neither of which can see, continue, close or take
over the other."""
from __future__ import annotations

import time
import uuid
from collections import OrderedDict

from ..tree.keys import session_key

#: turns kept per session for continuation (the oldest go first)
MAX_TURNS = 1024


class UnknownSession(LookupError):
    """A continuation of a session that is not open for the asking tenant: never opened,
    closed, expired, or another tenant's (one answer for all, so as not to tell them
    apart)."""


class Sessions:
    """(salt, session id) -> idle timeout (None: none) and last use; requests in flight
    keep a session open however long they run. Used on the scheduler thread only."""

    def __init__(self, default_timeout: float | None = None) -> None:
        self.default_timeout = default_timeout
        self._timeout: dict = {}  # by session_key(sid, salt), as all of these
        self._last: dict = {}
        self._active: dict = {}
        self._named: dict = {}    # (sid, salt) as the session was opened
        self._turns: dict = {}    # OrderedDict rid -> (prompt ids, output ids), newest last

    def __len__(self) -> int:
        return len(self._timeout)

    def is_open(self, sid, salt=None) -> bool:
        return session_key(sid, salt) in self._timeout

    def open(self, sid=None, timeout: float | None = None, salt=None) -> str:
        """Open session `sid` (None: a new id) of the tenant `salt`, or reset the timeout
        of that tenant's session of this id; returns the id."""
        sid = uuid.uuid4().hex if sid is None else sid
        key = session_key(sid, salt)
        self._timeout[key] = self.default_timeout if timeout is None else timeout
        self._last[key] = time.monotonic()
        self._active.setdefault(key, 0)
        self._named[key] = (sid, salt)
        return sid

    def begin(self, sid, salt=None) -> None:
        """A request of the session starts (a session first seen here opens itself)."""
        key = session_key(sid, salt)
        if key not in self._timeout:
            self.open(sid, salt=salt)
        self._active[key] += 1
        self._last[key] = time.monotonic()

    def end(self, sid, salt=None) -> None:
        key = session_key(sid, salt)
        if key in self._active:
            self._active[key] = max(0, self._active[key] - 1)
            self._last[key] = time.monotonic()

    def close(self, sid, salt=None) -> bool:
        key = session_key(sid, salt)
        self._last.pop(key, None)
        self._active.pop(key, None)
        self._turns.pop(key, None)
        self._named.pop(key, None)
        return self._timeout.pop(key, False) is not False

    # ------------------------------------------------------------------ continuation
    def record(self, sid, salt, rid: str, prompt, output) -> None:
        """A finished turn of an open session, continued from by its request id."""
        key = session_key(sid, salt)
        if key not in self._timeout:
            return  # closed meanwhile
        turns = self._turns.setdefault(key, OrderedDict())
        turns.pop(rid, None)
        turns[rid] = (tuple(prompt), tuple(output))
        while len(turns) > MAX_TURNS:
            turns.popitem(last=False)

    def context(self, sid, salt, rid: str | None, offset: int | None, drop_output: bool) -> list[int]:
        """The tokens a continuation builds on: turn `rid` of the tenant's open session
        `sid` (None: its latest; none yet: nothing), its prompt and, unless
        `drop_output`, its output, cut at `offset`. UnknownSession when the session is
        not open for this tenant (a continuation never opens one, nor starts over);
        ValueError names what else is missing."""
        key = session_key(sid, salt)
        if key not in self._timeout:
            raise UnknownSession(f"session_params.id: no open session {sid!r:.60} (never opened, or closed or "
                                 f"expired: open it again with /open_session and send the whole conversation)")
        turns = self._turns.get(key) or OrderedDict()
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
        self._last[key] = time.monotonic()  # in use: its idle time starts over
        return ctx

    def expired(self, now: float | None = None) -> list[tuple]:
        """Idle sessions past their timeout, as (id, salt) (closing them is the caller's)."""
        now = time.monotonic() if now is None else now
        return [self._named[k] for k, t in self._timeout.items()
                if t is not None and not self._active[k] and now - self._last[k] >= t]

    def next_deadline(self) -> float | None:
        ds = [self._last[k] + t for k, t in self._timeout.items() if t is not None and not self._active[k]]
        return min(ds, default=None)
