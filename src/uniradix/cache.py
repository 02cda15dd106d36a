"""UnifiedRadixCache: the one object an engine talks to.

The tree decides which handles to keep, reuse or evict; this class executes: it owns
the pools, allocates (evicting on shortfall), frees what the tree gives back, copies
MAMBA checkpoints into request-owned slots (copy-on-write), and keeps the counts.
"""
from __future__ import annotations

from array import array

from .tree import CheckpointComponent, LockReceipt, RadixTree, encode
from .tree.component import page_floor

_NEG = array("i", (-1,))


class CacheFull(RuntimeError):
    """The pools cannot hold what was asked even after evicting everything unlocked."""


class CachedRequest:
    """The cache's view of one running request.

    `key` holds the tokens whose state the request has or will compute. Page handles
    for pages below `prefix_len` belong to the tree (pinned by `receipt`); the rest are
    the request's own. `pages[name]` has one handle per allocated page, -1 where a
    windowed component's page was freed. `state_slot` is the request's private
    recurrent state (a copy of the checkpoint it resumed from), valid at `state_len`;
    `checkpoints` are further request-owned slots captured at page-aligned positions.
    `cached_tokens` is what it reused when it started; `matched` is its junction.
    `resume_points` are further positions (the prompt end, say) where later requests
    should be able to resume: like the junction, the SWA window before each is kept.
    """

    __slots__ = ("key", "salt", "priority", "prefix_len", "matched", "pages", "receipt", "node",
                 "state_slot", "state_len", "checkpoints", "window_freed", "done", "cached_tokens",
                 "resume_points")

    def __init__(self, key: bytes, salt, priority, prefix_len: int, matched: int,
                 pages: dict, receipt: LockReceipt, node) -> None:
        self.key = key
        self.salt = salt
        self.priority = priority
        self.prefix_len = prefix_len
        self.cached_tokens = prefix_len
        self.matched = matched
        self.pages = pages
        self.receipt = receipt
        self.node = node
        self.state_slot: int | None = None
        self.state_len = 0
        self.checkpoints: dict[int, int] = {}
        self.window_freed = 0
        self.done = False
        self.resume_points: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.key) // 4

    def __repr__(self) -> str:
        return (f"CachedRequest(tokens={self.num_tokens}, cached={self.cached_tokens}, "
                f"prefix_len={self.prefix_len}, matched={self.matched}, done={self.done})")


class UnifiedRadixCache:
    """tree: a RadixTree over the model's components; pools: per component name, an
    object with alloc(n) -> array('i'), free(handles) and `available` (and copy_slot for
    checkpoint components; without it, as with accounting-only allocators, nothing is
    copied)."""

    def __init__(self, tree: RadixTree, pools: dict, copy_checkpoints: bool = True):
        missing = [n for n in tree.names if n not in pools]
        if missing:
            raise ValueError(f"no pool for component(s) {missing}")
        self.tree = tree
        self.page_size = tree.page_size
        self.comps = tree.components
        self.names = tree.names
        self.pools = [pools[n] for n in tree.names]
        self.page_comps = [c for c in self.comps if not isinstance(c, CheckpointComponent)]
        ckpts = [c for c in self.comps if isinstance(c, CheckpointComponent)]
        if len(ckpts) > 1:
            raise ValueError("the cache drives one checkpoint component (one recurrent state per request)")
        self.ckpt = ckpts[0] if ckpts else None
        self.windowed = [c for c in self.page_comps if getattr(c, "window", None) is not None]
        self.copy_checkpoints = copy_checkpoints and self.ckpt is not None and \
            hasattr(self.pools[self.ckpt.index], "copy_slot")
        self._one_slot = [0] * len(self.pools)  # add_checkpoint's need
        if self.ckpt is not None:
            self._one_slot[self.ckpt.index] = 1
        self.requests = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0

    # ------------------------------------------------------------------ allocation
    def alloc(self, **counts: int) -> dict[str, array]:
        """Allocate per component name, evicting unlocked data on shortfall. All or
        nothing: raises CacheFull and allocates nothing when locked data leaves too little."""
        need = [0] * len(self.pools)
        for name, n in counts.items():
            if n < 0:
                raise ValueError(f"cannot allocate {n} {name} handles")
            need[self.tree.index[name]] = n
        got = self._alloc(need)
        return {name: got[self.tree.index[name]] for name in counts}

    def _alloc(self, need: list[int]) -> list:
        """alloc() by component index. Handles an eviction frees for a component being
        allocated go straight to the caller (tree -> request: they stay allocated), so
        only the excess returns to the pool."""
        pools = self.pools
        short = None
        for ci, k in enumerate(need):
            if k and pools[ci].available < k:
                if short is None:
                    short = [0] * len(need)
                short[ci] = k - pools[ci].available
        if short is None:
            return [pools[ci].alloc(k) if k else None for ci, k in enumerate(need)]
        got: list = [None] * len(need)
        for ci, h in enumerate(self.tree.evict_counts(short)):
            k = need[ci]
            if k and h:
                got[ci] = h[:k]
                h = h[k:]
            if h:
                pools[ci].free(h)
        for ci, k in enumerate(need):
            have = 0 if got[ci] is None else len(got[ci])
            if pools[ci].available < k - have:
                for cj, h in enumerate(got):
                    if h:
                        pools[cj].free(h)
                name = self.names[ci]
                raise CacheFull(
                    f"cannot allocate {k} {name} handles: {pools[ci].available + have} free and "
                    f"{self.tree.evictable(name)} evictable; the rest is locked by running requests")
        for ci, k in enumerate(need):
            if not k:
                continue
            have = got[ci]
            if have is None:
                got[ci] = pools[ci].alloc(k)
            elif len(have) < k:
                have += pools[ci].alloc(k - len(have))
        return got

    def free(self, **handles) -> None:
        for name, h in handles.items():
            if h:
                self.pools[self.tree.index[name]].free(h)

    def _evict(self, **targets: int):
        ev = self.tree.evict(**targets)
        self._give_back(ev.freed)
        return ev

    def evict(self, **targets: int):
        """Evict explicitly (e.g. to make room ahead of time); returns the EvictResult."""
        return self._evict(**targets)

    def _give_back(self, freed: dict[str, array]) -> None:
        for name, h in freed.items():
            if h:
                self.pools[self.tree.index[name]].free(h)

    # ------------------------------------------------------------------ request lifecycle
    def match_prefix(self, tokens, salt=None, priority: int | None = None,
                     alloc: bool = False) -> CachedRequest:
        """Match, lock what the match returns, and give the request a private copy of
        the checkpoint it resumes from. With `alloc`, also allocate the request's own
        pages for all of `tokens` in the same step (what alloc_request would do), so an
        eviction made for one component hands its other freed pages straight over.
        On CacheFull nothing stays locked or allocated."""
        key = tokens if isinstance(tokens, bytes) else encode(tokens)
        m = self.tree.match(key, salt, priority, lock=True)
        rc = m.receipt
        b = m.boundary
        P = self.page_size
        pages = {}
        need = [0] * len(self.pools)
        want = -(-(len(key) >> 2) // P) if alloc else 0
        for c in self.page_comps:
            h = m.handles[c.name]
            if c.window is not None:
                h = _NEG * (b // P - len(h)) + h
            pages[c.name] = h
            if want > len(h):
                need[c.index] = want - len(h)
        req = CachedRequest(key, salt, priority, b, m.matched, pages, rc, m.node)
        if self.ckpt is not None:
            need[self.ckpt.index] = 1
        if any(need):
            try:
                got = self._alloc(need)
            except CacheFull:
                self.tree.unlock(rc)
                raise
            for c in self.page_comps:
                if got[c.index] is not None:
                    pages[c.name] += got[c.index]
            if self.ckpt is not None:
                slot = got[self.ckpt.index][0]
                src = m.handles[self.ckpt.name]
                if src:
                    if self.copy_checkpoints:
                        self.pools[self.ckpt.index].copy_slot(src[0], slot)
                    req.state_len = b
                req.state_slot = slot
        self.requests += 1
        self.prompt_tokens += len(key) // 4
        self.hit_tokens += b
        return req

    def alloc_request(self, req: CachedRequest, upto: int | None = None) -> None:
        """Allocate the request's own pages so they cover its first `upto` tokens (all by default)."""
        n = (len(req.key) >> 2) if upto is None else upto
        want = -(-n // self.page_size)
        pages = req.pages
        need = None
        for c in self.page_comps:
            k = want - len(pages[c.name])
            if k > 0:
                if need is None:
                    need = [0] * len(self.pools)
                need[c.index] = k
        if need is None:
            return
        got = self._alloc(need)
        for c in self.page_comps:
            h = got[c.index]
            if h is not None:
                pages[c.name] += h

    def append_tokens(self, req: CachedRequest, tokens) -> None:
        """Decode: extend the request by `tokens` and allocate their pages; on CacheFull
        the request is unchanged."""
        more = tokens if isinstance(tokens, bytes) else encode(tokens)
        self.alloc_request(req, (len(req.key) + len(more)) >> 2)  # CacheFull leaves req as it was
        req.key += more

    def add_checkpoint(self, req: CachedRequest, pos: int) -> int:
        """A request-owned slot to capture the recurrent state at `pos` into; it goes to
        the tree with the request (the junction checkpoint, say)."""
        if self.ckpt is None:
            raise ValueError("this cache has no checkpoint component")
        if pos % self.page_size:
            raise ValueError(f"checkpoint position {pos} is not page-aligned ({self.page_size})")
        if pos in req.checkpoints:
            return req.checkpoints[pos]
        slot = self._alloc(self._one_slot)[self.ckpt.index][0]
        req.checkpoints[pos] = slot
        return slot

    def release_out_of_window(self, req: CachedRequest, upto: int | None = None) -> int:
        """Free the request's own SWA pages that fell out of the window, except the
        windows at its junction and resume points; returns how many were freed. The
        window kept is the one ending at the page-aligned end (what the tree will cache),
        which also covers the window that decoding still reads. `upto` (default: all its
        tokens) is how far the request has computed, for a chunked prefill whose later
        chunks still read the window before them."""
        P = self.page_size
        end = page_floor(req.num_tokens if upto is None else min(upto, req.num_tokens), P)
        freed = 0
        mark = None
        for c in self.windowed:
            stop = c.window_start(end) // P
            kept = [(c.window_start(j) // P, j // P) for j in (req.matched, *req.resume_points)]
            freed += self._free_own(req, c, max(req.window_freed, req.prefix_len // P), stop, kept)
            mark = stop if mark is None else min(mark, stop)
        if mark is not None and mark > req.window_freed:
            req.window_freed = mark
        return freed

    def resumed_from(self, req: CachedRequest, upto: int) -> int:
        """The request's own pages and state were filled from another tier up to `upto`
        (page-aligned, past its prefix): it now resumes there. Its own windowed pages
        below the window before `upto` hold nothing and are freed (no junction window
        is kept for them); returns how many were freed."""
        P = self.page_size
        if upto % P or upto < req.prefix_len or upto > req.num_tokens:
            raise ValueError(f"cannot resume at {upto}: prefix {req.prefix_len}, {req.num_tokens} tokens, page {P}")
        freed = sum(self._free_own(req, c, req.prefix_len // P, c.window_start(upto) // P, ())
                    for c in self.windowed)
        req.cached_tokens = upto
        if req.state_slot is not None:
            req.state_len = upto
        return freed

    def _free_own(self, req: CachedRequest, c, start: int, stop: int, kept) -> int:
        """Free the request's present pages of component c in pages [start, stop), except
        those inside a kept (lo, hi) page range; they become -1."""
        pages = req.pages[c.name]
        out = array("i")
        for p in range(start, min(stop, len(pages))):
            h = pages[p]
            if h >= 0 and not any(lo <= p < hi for lo, hi in kept):
                out.append(h)
                pages[p] = -1
        if out:
            self.pools[c.index].free(out)
        return len(out)

    def cache_unfinished(self, req: CachedRequest, checkpoints: dict[int, int] | None = None) -> None:
        """Insert what the running request has so far; it keeps going on the tree's copy."""
        if checkpoints:
            req.checkpoints.update(checkpoints)
        old = req.receipt
        node, req.receipt = self._insert(req, finished=False)
        req.node = node
        self._unlock(old)

    def cache_finished(self, req: CachedRequest, session_id=None) -> object:
        """Insert the finished request, free what the tree did not keep, release its
        lock; with a session id, reference what the next turn will reuse. Returns the
        node the request ends at."""
        node, _ = self._insert(req, finished=True)
        self._unlock(req.receipt)
        req.done = True
        if session_id is not None and node.parent is not None:
            self.tree.register_session(session_id, node)
        return node

    def release(self, req: CachedRequest) -> None:
        """Abort: free everything the request owns and unlock, caching nothing."""
        P = self.page_size
        for c in self.page_comps:
            own = req.pages[c.name][req.prefix_len // P:]
            self.pools[c.index].free(array("i", (h for h in own if h >= 0)))
        if self.ckpt is not None:
            slots = list(req.checkpoints.values())
            if req.state_slot is not None:
                slots.append(req.state_slot)
            if slots:
                self.pools[self.ckpt.index].free(array("i", slots))
        req.checkpoints.clear()
        req.state_slot = None
        self._unlock(req.receipt)
        req.done = True

    def _unlock(self, rc: LockReceipt) -> None:
        gone = self.tree.unlock(rc)
        if gone:
            self._give_back(gone)

    def _insert(self, req: CachedRequest, finished: bool):
        P = self.page_size
        n = page_floor(req.num_tokens, P)
        npages = n // P
        values = {}
        for c in self.page_comps:
            pages = req.pages[c.name]
            if len(pages) < npages:
                raise ValueError(f"request has {len(pages)} {c.name} pages, needs {npages}: call alloc_request first")
            values[c.name] = pages[:npages] if len(pages) > npages else pages
        if self.ckpt is not None:
            # positions that cannot take a checkpoint come back from the tree in r.free
            ck = req.checkpoints
            req.checkpoints = {}
            slot = req.state_slot
            if finished and slot is not None:
                req.state_slot = None
                if req.state_len == n and n not in ck:
                    ck[n] = slot
                else:  # the state is not at the cached end: nothing to keep it for
                    self.pools[self.ckpt.index].free(array("i", (slot,)))
            values[self.ckpt.name] = ck
        marks = (req.matched, *req.resume_points) if req.resume_points else req.matched
        r = self.tree.insert(req.key, values, req.prefix_len, marks, req.salt, req.priority,
                             not finished)
        for ci, h in enumerate(r.outs):
            if h:
                self.pools[ci].free(h)
        node = r.node
        req.prefix_len = n
        if finished:
            for c in self.page_comps:
                pages = req.pages[c.name]
                if len(pages) > npages:  # the unaligned tail is not cached
                    self.pools[c.index].free(array("i", (h for h in pages[npages:] if h >= 0)))
            req.pages = {}
            return node, r.receipt
        # the tree now owns [0, n): the request goes on with the tree's handles
        path = node.path()
        for c in self.page_comps:
            req.pages[c.name] = self._tree_pages(c, path) + req.pages[c.name][npages:]
        return node, r.receipt

    @staticmethod
    def _tree_pages(c, path) -> array:
        ci = c.index
        P = c.page
        out = array("i")
        for nd in path:
            v = nd.value[ci]
            out += v if v is not None else _NEG * ((nd.end - nd.start) // P)
        return out

    # ------------------------------------------------------------------ sessions and admin
    def close_session(self, session_id) -> bool:
        return self.tree.close_session(session_id)

    def flush(self) -> bool:
        """Drop everything cached. Refused (False) while requests hold locks."""
        if any(self.tree.locked):
            return False
        self._evict(**{c.evict_kw: self.tree.size[c.index] + 1 for c in self.comps[:1]})
        for sid in list(self.tree.sessions):
            self.tree.close_session(sid)
        return True

    def stats(self) -> dict:
        t = self.tree.stats()
        for c, pool in zip(self.comps, self.pools):
            t["components"][c.name]["pool_available"] = pool.available
            t["components"][c.name]["pool_size"] = getattr(pool, "size", None)
        t["requests"] = self.requests
        t["prompt_tokens"] = self.prompt_tokens
        t["hit_tokens"] = self.hit_tokens
        t["hit_rate"] = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return t
