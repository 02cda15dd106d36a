"""When a request ends: its tokens go into the tree (or, on abort, everything it owns
goes back), and the host tier takes the copies its policy says."""
from __future__ import annotations

from array import array

from ..tree import LockReceipt
from ..tree.component import page_floor
from ..tree.keys import TOKEN_BYTES, check_session_id
from .request import RequestState

_NEG = array("i", (-1,))


class Finishing:
    """UnifiedRadixCache's end of a request (a mixin: the state lives on the cache)."""

    def cache_unfinished(self, req: RequestState, checkpoints: dict[int, int] | None = None,
                         upto: int | None = None) -> None:
        """Insert what the running request has so far (with `upto`, its first `upto`
        tokens: page-aligned, computed, and the window and checkpoint a resume there
        needs still its own: see `shareable`); it keeps going on the tree's copy, and
        its checkpoints past the insert stay its own to capture."""
        if checkpoints:
            req.checkpoints.update(checkpoints)
        if upto is not None and (upto % self.page_size or upto > req.computed or upto > req.allocated):
            raise ValueError(f"cannot cache the first {upto} tokens: {req.computed} computed, "
                             f"{req.allocated} allocated, page {self.page_size}")
        old = req.receipt
        req.node, req.receipt = self._insert(req, finished=False, upto=upto)
        self._unlock(old)

    def cache_finished(self, req: RequestState, session_id=None) -> object:
        """Insert the finished request, free what the tree did not keep, release its
        lock; with a session id, reference what the next turn will reuse (the session
        of the request's tenant, its salt). Returns the node the request ends at."""
        if session_id is not None:
            check_session_id(session_id)  # before the insert: a bad id changes nothing
        node, _ = self._insert(req, finished=True)
        self._unlock(req.receipt)
        req.receipt, req.held = None, False
        if session_id is not None and node.parent is not None:
            self.tree.register_session(session_id, node, req.salt)
        if self.host is not None:
            if req.staged is not None:
                self.host.adopt(req.staged, node)  # writes through the rest too
                req.staged = None
            elif node.parent is not None:
                self.host.write_through(node)
        return node

    def release(self, req: RequestState) -> None:
        """Abort: free everything the request owns and unlock, caching nothing more (what
        it already handed the tree stays: a prefix it shared, its prompt's chunks with
        spare windows)."""
        if self.host is not None:
            self.host.sync()  # a load may still be writing its state slot
            if req.staged is not None:
                self.host.adopt(req.staged, None)
                req.staged = None
        P = self.page_size
        for c in self.page_comps:
            own = req.pages[c.name][req.prefix_len // P:]
            self.ledger.free_device(c.index, array("i", (h for h in own if h >= 0)))
        if self.ckpt is not None:
            slots = [*req.checkpoints.values(), *req.scratch.values()]
            if req.state_slot is not None:
                slots.append(req.state_slot)
            self.ledger.free_device(self.ckpt.index, slots)
        req.checkpoints, req.scratch = {}, {}
        req.state_slot = None
        self._unlock(req.receipt)
        req.receipt, req.held = None, False

    def _unlock(self, rc: LockReceipt) -> None:
        freed = self.tree.unlock(rc)
        if freed is not None:
            self.ledger.free(freed)

    def _insert(self, req: RequestState, finished: bool, upto: int | None = None):
        P = self.page_size
        n = page_floor(req.allocated if upto is None else upto, P)
        npages = n // P
        key = req.key if upto is None else req.key[:n * TOKEN_BYTES]
        values, tails = {}, False
        for c in self.page_comps:
            pages = req.pages[c.name]
            if len(pages) < npages and c.window is not None:  # pages it never took a window for: absent
                pages = req.pages[c.name] = pages + _NEG * (npages - len(pages))
            if len(pages) != npages:
                if len(pages) < npages:
                    raise ValueError(f"request has {len(pages)} {c.name} pages, needs {npages}: "
                                     f"call alloc_request first")
                pages, tails = pages[:npages], True
            values[c.name] = pages
        if self.ckpt is not None:
            values[self.ckpt.name] = self._checkpoints_to_insert(req, n, finished)
        points = (req.junction, *req.resume_points) if req.resume_points else req.junction
        r = self.tree.insert(key, values, req.prefix_len, points, req.salt, req.priority, not finished)
        self.ledger.free(r.free)
        node = r.node
        req.prefix_len = n
        if finished:
            if tails:  # the unaligned tail is not cached
                for c in self.page_comps:
                    pages = req.pages[c.name]
                    if len(pages) > npages:
                        self.ledger.free_device(c.index, array("i", (h for h in pages[npages:] if h >= 0)))
            req.pages = {}
            return node, r.receipt
        # the tree now owns [0, n): the request goes on with the tree's handles
        path = node.path()
        for c in self.page_comps:
            req.pages[c.name] = self.tree.path_pages(path, c.index) + req.pages[c.name][npages:]
        return node, r.receipt

    def _checkpoints_to_insert(self, req: RequestState, n: int, finished: bool) -> dict:
        """The request's checkpoints, and its own state slot at the cached end when the
        state is there (positions that cannot take one come back from the tree freed)."""
        ck, req.checkpoints = req.checkpoints, {}
        if not finished:  # the ones past the insert are still to be captured
            req.checkpoints = {p: s for p, s in ck.items() if p > n}
            ck = {p: s for p, s in ck.items() if p <= n}
            if req.rolling is not None and req.rolling not in req.checkpoints:
                req.rolling = None  # the tree has it now: the next page boundary takes a new one
        slot = req.state_slot
        if finished and slot is not None:
            req.state_slot = None
            if req.computed == n and n not in ck:
                ck[n] = slot
            else:  # the state is not at the cached end: nothing to keep it for
                self.ledger.free_device(self.ckpt.index, (slot,))
        return ck
