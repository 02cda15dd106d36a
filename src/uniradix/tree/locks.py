"""Locks and session references: what reuse at a node needs, pinned per component.

A lock is a receipt that records exactly which slots it pinned (SWA its window, MAMBA
one node); unlocking releases exactly those. A session reference ranks the same slots
last for eviction without pinning them."""
from __future__ import annotations

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
                        tier = 2 if nd.refs[ci] else 1
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
    def register_session(self, session_id, nd: Node) -> None:
        """Reference what a finished request of this session would reuse next turn."""
        self.close_session(session_id)
        self.sessions[session_id] = self._pin_all(nd, False)

    def close_session(self, session_id) -> bool:
        rc = self.sessions.pop(session_id, None)
        if rc is None:
            return False
        for ci, nd, lo in rc.pins:
            self._pin(ci, nd, lo, -1, False)
        return True
