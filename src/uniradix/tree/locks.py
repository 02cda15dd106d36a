"""Locks and session references: what reuse at a node needs, pinned per component.

A lock is a receipt that records exactly which slots it pinned (SWA its window, MAMBA
one node); unlocking releases exactly those. A session reference ranks the same slots
last for eviction without pinning them."""
from __future__ import annotations

from .keys import session_key
from .node import Node
from .results import Freed, LockReceipt


class LockError(RuntimeError):
    """Unlocking a receipt that was already unlocked."""


class Locking:
    """RadixTree's locks and sessions (a mixin: the state lives on the tree)."""

    # ------------------------------------------------------------------ locks
    def lock(self, nd: Node) -> LockReceipt:
        """Pin what reuse at nd.end needs: FULL along the path, SWA its window, MAMBA the
        checkpoint. Locked slots are never evicted."""
        return self._pin_all(nd, True)

    def _pin_all(self, nd: Node, is_lock: bool) -> LockReceipt:
        """What lock (or a session reference) at nd pins, per component, counted up."""
        rc = LockReceipt(nd)
        if nd.parent is None:
            return rc
        pins = rc.pins
        for c in self.components:
            lo = c.pin_from(nd)
            if lo is None:
                continue
            if lo > 0:
                self._ensure_boundary(nd, lo)
            ci = c.index
            pins.append((ci, nd, lo))
            self._pin(ci, nd, lo, 1, is_lock)
        return rc

    def unlock(self, rc: LockReceipt) -> Freed | None:
        """Release exactly what `rc` pinned. A leaf that became useless while locked goes
        now; its handles are returned for the caller to free (None when nothing went)."""
        if rc.released:
            raise LockError("receipt already unlocked")
        rc.released = True
        for ci, nd, lo in rc.pins:
            self._pin(ci, nd, lo, -1, True)
        nd = rc.node
        if rc.pins and nd.attached and not nd.children and not nd.locks[0] and not self._useful(nd):
            freed = self.freed()
            parent = nd.parent
            self._remove(nd, freed)
            self._prune_up(parent, freed)
            return freed
        return None

    def _pin(self, ci: int, nd: Node, lo: int, delta: int, is_lock: bool) -> None:
        """Walk the pinned span (see Component.pin_from) and move lock or reference counts
        (delta +1 or -1)."""
        stop = nd.parent if lo < 0 else None  # lo < 0: the node alone
        if not is_lock:
            while nd is not stop and nd.parent is not None and nd.end > lo:
                nd.refs[ci] += delta
                self._place(ci, nd)
                if self.hosted:
                    self._place(ci, nd, True)
                nd = nd.parent
            return
        # the handles whose slot becomes pinned (or unpinned), added to the totals once;
        # with lo >= 0 the walk ends at the root, whose end (0) is never past lo
        dev = hst = 0
        hosted = self.hosted  # before any host copy, every host slot is None
        if delta > 0:
            while nd is not stop and nd.end > lo:
                locks = nd.locks
                if not locks[ci]:  # stays listed; eviction skips it
                    v = nd.value[ci]
                    if v is not None:
                        dev += len(v)
                    if hosted and nd.host[ci] is not None:
                        hst += len(nd.host[ci])
                locks[ci] += 1
                nd = nd.parent
            self.locked[ci] += dev
            if hst:
                self.host_locked[ci] += hst
            return
        while nd is not stop and nd.end > lo:
            locks = nd.locks
            left = locks[ci] - 1
            locks[ci] = left
            if not left:  # references may have changed while locked: re-rank
                v = nd.value[ci]
                if v is not None:
                    dev += len(v)
                    if ci or not nd.children:  # the common case, inline
                        tier = 2 if nd.refs[ci] else 3 if nd.spare >> ci & 1 else 1
                        if tier == 2 or nd.where[ci] != tier:
                            self.lists[ci].place(nd, tier)
                    elif hosted:  # without a host tier every child holds FULL on the device
                        self._place(ci, nd)
                if hosted and nd.host[ci] is not None:
                    hst += len(nd.host[ci])
                    self._place(ci, nd, True)
            nd = nd.parent
        self.locked[ci] -= dev
        if hst:
            self.host_locked[ci] -= hst

    # ------------------------------------------------------------------ sessions
    def register_session(self, session_id, nd: Node, salt=None) -> None:
        """Reference what a finished request of this session would reuse next turn. A
        session is its tenant's (`salt`, the request's: keys.session_key): another
        tenant's turn under the same id never replaces this reference."""
        key = session_key(session_id, salt)
        self._unreference(self.sessions.pop(key, None))
        self.sessions[key] = self._pin_all(nd, False)

    def close_session(self, session_id, salt=None) -> bool:
        """Drop the references of session `session_id` of the tenant `salt` (False: it
        had none; another tenant's session of that id is untouched)."""
        return self._unreference(self.sessions.pop(session_key(session_id, salt), None))

    def close_all_sessions(self) -> int:
        """Drop every session's references (a flush); how many there were."""
        keys = list(self.sessions)
        for key in keys:
            self._unreference(self.sessions.pop(key))
        return len(keys)

    def _unreference(self, rc: LockReceipt | None) -> bool:
        if rc is None:
            return False
        for ci, nd, lo in rc.pins:
            self._pin(ci, nd, lo, -1, False)
        return True
