"""UnifiedRadixCache: the one object an engine talks to.

The tree decides which handles to keep, reuse or evict; the cache executes: it owns the
pools, allocates (evicting on shortfall, through the ledger), frees what the tree gives
back, and copies MAMBA checkpoints into request-owned slots (copy-on-write). With host
pools it has a host tier (hicache.l2.HostTier) that loads what a match needs from the
host and copies down what the write policy says."""
from __future__ import annotations

from array import array

from ..hicache.l2 import HostTier, Staged
from ..hicache.transfer import CopyJob
from ..tree import LockReceipt, RadixTree, encode
from ..tree.component import page_floor
from ..tree.keys import check_priority, check_session_id, salt_key
from .handles import CacheFull, Ledger
from .request import RequestState

_NEG = array("i", (-1,))

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class UnifiedRadixCache:
    """tree: a RadixTree over the model's components; pools: per component name, an
    object with alloc(n) -> array('i'), free(handles) and `available` (and copy_slot for
    a checkpoint component; without it, as with accounting-only allocators, nothing is
    copied). host_pools: the host tier's mirrors by name (L2), or None."""

    def __init__(self, tree: RadixTree, pools: dict, copy_checkpoints: bool = True,
                 host_pools: dict | None = None, write_policy: str = "write_through",
                 write_through_threshold: int = 2):
        missing = [n for n in tree.names if n not in pools]
        if missing:
            raise ValueError(f"no pool for component(s) {missing}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; choose one of {', '.join(WRITE_POLICIES)}")
        if type(write_through_threshold) is not int or write_through_threshold < 1:
            raise ValueError(f"write_through_threshold must be an int >= 1, got {write_through_threshold!r}")
        self.tree = tree
        self.page_size = tree.page_size
        self.comps = tree.components
        self.names = tree.names
        self.pools = [pools[n] for n in tree.names]
        self.page_comps = [c for c in self.comps if not c.checkpoint]
        ckpts = [c for c in self.comps if c.checkpoint]
        if len(ckpts) > 1:
            raise ValueError("the cache drives one checkpoint component (one recurrent state per request)")
        self.ckpt = ckpts[0] if ckpts else None
        self.windowed = [c for c in self.page_comps if c.window is not None]
        self.copy_checkpoints = copy_checkpoints and self.ckpt is not None and \
            hasattr(self.pools[self.ckpt.index], "copy_slot")
        self._one_slot = [0] * len(self.pools)  # add_checkpoint's need
        if self.ckpt is not None:
            self._one_slot[self.ckpt.index] = 1
        self.requests = self.prompt_tokens = self.hit_tokens = 0
        self.write_policy = write_policy
        self.write_min_hits = write_through_threshold if write_policy == "write_through_selective" else 0
        self.host = None
        if host_pools is not None:
            missing = [n for n in tree.names if n not in host_pools]
            if missing:
                raise ValueError(f"no host pool for component(s) {missing}")
            self.host = HostTier(tree, self.pools, [host_pools[n] for n in tree.names], write_policy,
                                 self.write_min_hits, self.ckpt.index if self.ckpt else None)
        self.ledger = Ledger(tree, self.pools, self.host)
        if self.host is not None:
            self.host.ledger = self.ledger

    @property
    def host_pools(self) -> list | None:
        return None if self.host is None else self.host.pools

    @property
    def pending_loads(self) -> list:
        return [] if self.host is None else self.host.pending

    # ------------------------------------------------------------------ allocation
    def alloc(self, **counts: int) -> dict[str, array]:
        """Allocate per component name, evicting unlocked data on shortfall. All or
        nothing: raises CacheFull and allocates nothing when locked data leaves too little."""
        need = [0] * len(self.pools)
        for name, n in counts.items():
            if n < 0:
                raise ValueError(f"cannot allocate {n} {name} handles")
            need[self.tree.index[name]] = n
        got = self.ledger.alloc(need)
        return {name: got[self.tree.index[name]] for name in counts}

    def free(self, **handles) -> None:
        for name, h in handles.items():
            self.ledger.free_device(self.tree.index[name], h)

    def evict(self, **targets: int):
        """Evict explicitly (to make room ahead of time), as a shortfall would (with the
        host tier's copies down); returns the EvictResult."""
        from ..tree.results import EvictResult
        tree = self.tree
        removed0, tomb0 = tree.removed_nodes, sum(tree.tombstones)
        freed = self.ledger.evict(tree._targets(targets))
        return EvictResult(freed, tree.removed_nodes - removed0, sum(tree.tombstones) - tomb0)

    # ------------------------------------------------------------------ a request starts
    def match_prefix(self, tokens, salt=None, priority: int | None = None, alloc: bool = False,
                     state: RequestState | None = None) -> RequestState:
        """Match, lock what the match returns, and give the request a private copy of
        the checkpoint it resumes from (into `state`, or a new RequestState). With `alloc`,
        also allocate the request's own pages for all of `tokens` in the same step, so an
        eviction made for one component hands its other freed pages straight over. What
        only the host holds is loaded back (all or nothing; else the request resumes at
        the device's boundary). On CacheFull nothing stays locked or allocated."""
        check_priority(priority)  # before the tree sees them: a bad one fails here, nothing held
        salt_key(salt)
        key = tokens if isinstance(tokens, bytes) else encode(tokens)
        if state is None:
            state = RequestState(salt=salt, priority=priority)
        m = self.tree.match(key, salt, priority, lock=True)
        if m.loads:
            try:
                return self._start(state, key, m, salt, priority, alloc)
            except CacheFull:  # the host's part cannot come back now: reuse the device's
                self.host.counters["failed_loads"] += 1
                self._unlock(m.receipt)
                m = self.tree.match(key, salt, priority, lock=True, host=False)
            except BaseException:
                self._unlock(m.receipt)
                raise
        try:
            return self._start(state, key, m, salt, priority, alloc)
        except BaseException:
            self._unlock(m.receipt)
            raise

    def _start(self, state: RequestState, key: bytes, m, salt, priority, alloc: bool) -> RequestState:
        """Allocate what the request needs (its own pages, its state slot, device room
        for the slots to load from the host) in one all-or-nothing step, start the
        load, and hand out the reused handles."""
        b, P = m.boundary, self.page_size
        need = [0] * len(self.pools)
        for ci, nd in m.loads:
            need[ci] += len(nd.host[ci])
        want = -(-(len(key) >> 2) // P) if alloc else 0
        if want > b // P:
            for c in self.page_comps:
                need[c.index] += want - b // P
        if self.ckpt is not None:
            need[self.ckpt.index] += 1
        got = self.ledger.alloc(need) if any(need) else None
        handles, jobs = m.handles, []
        if m.loads:
            jobs = self.host.load(m.loads, got)
            handles = self.tree.handles_at(m.node)
        pages = {}
        for c in self.page_comps:
            h = handles[c.name]
            if c.window is not None:
                h = _NEG * (b // P - len(h)) + h
            own = got[c.index] if got is not None else None
            pages[c.name] = h + own if own else h
        state.key, state.salt, state.priority = key, salt, priority
        state.prefix_len = state.reused = state.computed = b
        state.junction, state.pages, state.receipt, state.node = m.matched, pages, m.receipt, m.node
        state.host_tokens = m.host_tokens if m.loads else 0
        state.held = True
        if self.ckpt is not None:
            jobs += self._private_state(state, m, handles, got)
        if jobs:
            self.host.start(jobs)
        self.requests += 1
        self.prompt_tokens += len(key) >> 2
        self.hit_tokens += b
        return state

    def _private_state(self, state: RequestState, m, handles, got) -> list[CopyJob]:
        """The request's own state slot: a copy of the checkpoint it resumes from (from
        the host when only the host holds it: returned as the load's job)."""
        ci = self.ckpt.index
        slot = got[ci][0]
        state.state_slot = slot
        src = handles[self.ckpt.name]
        if not src:
            state.computed = 0 if m.boundary == 0 else state.computed
            return []
        loaded = next((nd for cj, nd in m.loads if cj == ci), None)
        if loaded is not None:
            return [self.host.job(ci, loaded.host[ci], array("i", (slot,)))]
        if self.copy_checkpoints:
            self.pools[ci].copy_slot(src[0], slot)
        return []

    def zero_state(self, state: RequestState) -> None:
        """A request that resumes from nothing starts from a zero recurrent state."""
        if state.state_slot is not None and state.prefix_len == 0 and hasattr(self.pools[self.ckpt.index],
                                                                               "zero_slots"):
            self.pools[self.ckpt.index].zero_slots([state.state_slot])

    # ------------------------------------------------------------------ a request runs
    def alloc_request(self, req: RequestState, upto: int | None = None) -> None:
        """Allocate the request's own pages so they cover its first `upto` tokens (all by default)."""
        n = req.allocated if upto is None else upto
        want = -(-n // self.page_size)
        pages, need = req.pages, None
        for c in self.page_comps:
            k = want - len(pages[c.name])
            if k > 0:
                if need is None:
                    need = [0] * len(self.pools)
                need[c.index] = k
        if need is None:
            return
        got = self.ledger.alloc(need)
        for c in self.page_comps:
            h = got[c.index]
            if h is not None:
                pages[c.name] += h

    def append_tokens(self, req: RequestState, tokens) -> None:
        """Decode: extend the request by `tokens` and allocate their pages; on CacheFull
        the request is unchanged."""
        more = tokens if isinstance(tokens, bytes) else encode(tokens)
        self.alloc_request(req, (len(req.key) + len(more)) >> 2)  # CacheFull leaves req as it was
        req.key += more

    def add_checkpoint(self, req: RequestState, pos: int) -> int:
        """A request-owned slot to capture the recurrent state at `pos` into; it goes to
        the tree with the request (the junction checkpoint, say)."""
        if self.ckpt is None:
            raise ValueError("this cache has no checkpoint component")
        if pos % self.page_size:
            raise ValueError(f"checkpoint position {pos} is not page-aligned ({self.page_size})")
        if pos in req.checkpoints:
            return req.checkpoints[pos]
        slot = self.ledger.alloc(self._one_slot)[self.ckpt.index][0]
        req.checkpoints[pos] = slot
        return slot

    def release_out_of_window(self, req: RequestState, upto: int | None = None) -> int:
        """Free the request's own windowed pages that fell out of the window, except the
        windows at its junction and resume points; returns how many were freed. The
        window kept is the one ending at the page-aligned end (what the tree will cache),
        which also covers the window that decoding still reads. `upto` (default: all it
        allocated) is how far the request has computed, for a chunked prefill whose later
        chunks still read the window before them."""
        P = self.page_size
        end = page_floor(req.allocated if upto is None else min(upto, req.allocated), P)
        freed, mark = 0, None
        for c in self.windowed:
            stop = c.window_start(end) // P
            kept = [(c.window_start(j) // P, j // P) for j in (req.junction, *req.resume_points)]
            freed += self._free_own(req, c, max(req.window_freed, req.prefix_len // P), stop, kept)
            mark = stop if mark is None else min(mark, stop)
        if mark is not None and mark > req.window_freed:
            req.window_freed = mark
        return freed

    def resumed_from(self, req: RequestState, upto: int) -> int:
        """The request's own pages and state were filled from another tier up to `upto`
        (page-aligned, past its prefix): it now resumes there. Its own windowed pages
        below the window before `upto` hold nothing and are freed (no junction window
        is kept for them); returns how many were freed."""
        P = self.page_size
        if upto % P or upto < req.prefix_len or upto > req.allocated:
            raise ValueError(f"cannot resume at {upto}: prefix {req.prefix_len}, {req.allocated} tokens, page {P}")
        freed = sum(self._free_own(req, c, req.prefix_len // P, c.window_start(upto) // P, ())
                    for c in self.windowed)
        req.reused = req.computed = upto
        return freed

    def _free_own(self, req: RequestState, c, start: int, stop: int, kept) -> int:
        """Free the request's present pages of component c in pages [start, stop), except
        those inside a kept (lo, hi) page range; they become -1."""
        pages = req.pages[c.name]
        out = array("i")
        for p in range(start, min(stop, len(pages))):
            h = pages[p]
            if h >= 0 and not any(lo <= p < hi for lo, hi in kept):
                out.append(h)
                pages[p] = -1
        self.ledger.free_device(c.index, out)
        return len(out)

    def stage_fetched(self, req: RequestState, fetched) -> bool:
        """Land data read from L3 in the host tier and load it into the request's pages
        layer by layer (see HostTier.stage); False without a host tier or room."""
        if self.host is None:
            return False
        if req.staged is None:
            req.staged = Staged()
        return self.host.stage(req.staged, fetched, fetched.b)

    # ------------------------------------------------------------------ a request ends
    def cache_unfinished(self, req: RequestState, checkpoints: dict[int, int] | None = None) -> None:
        """Insert what the running request has so far; it keeps going on the tree's copy."""
        if checkpoints:
            req.checkpoints.update(checkpoints)
        old = req.receipt
        req.node, req.receipt = self._insert(req, finished=False)
        self._unlock(old)

    def cache_finished(self, req: RequestState, session_id=None) -> object:
        """Insert the finished request, free what the tree did not keep, release its
        lock; with a session id, reference what the next turn will reuse. Returns the
        node the request ends at."""
        check_session_id(session_id)  # before the insert: a bad id changes nothing
        node, _ = self._insert(req, finished=True)
        self._unlock(req.receipt)
        req.receipt, req.held = None, False
        if session_id is not None and node.parent is not None:
            self.tree.register_session(session_id, node)
        if self.host is not None:
            if req.staged is not None:
                self.host.adopt(req.staged, node)  # writes through the rest too
                req.staged = None
            elif node.parent is not None:
                self.host.write_through(node)
        return node

    def release(self, req: RequestState) -> None:
        """Abort: free everything the request owns and unlock, caching nothing."""
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
            slots = list(req.checkpoints.values())
            if req.state_slot is not None:
                slots.append(req.state_slot)
            self.ledger.free_device(self.ckpt.index, slots)
        req.checkpoints = {}
        req.state_slot = None
        self._unlock(req.receipt)
        req.receipt, req.held = None, False

    def _unlock(self, rc: LockReceipt) -> None:
        self.ledger.free(self.tree.unlock(rc))

    def _insert(self, req: RequestState, finished: bool):
        P = self.page_size
        n = page_floor(req.allocated, P)
        npages = n // P
        values = {}
        for c in self.page_comps:
            pages = req.pages[c.name]
            if len(pages) < npages:
                raise ValueError(f"request has {len(pages)} {c.name} pages, needs {npages}: call alloc_request first")
            values[c.name] = pages[:npages] if len(pages) > npages else pages
        if self.ckpt is not None:
            values[self.ckpt.name] = self._checkpoints_to_insert(req, n, finished)
        points = (req.junction, *req.resume_points) if req.resume_points else req.junction
        r = self.tree.insert(req.key, values, req.prefix_len, points, req.salt, req.priority, not finished)
        self.ledger.free(r.free)
        node = r.node
        req.prefix_len = n
        if finished:
            for c in self.page_comps:
                pages = req.pages[c.name]
                if len(pages) > npages:  # the unaligned tail is not cached
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
        slot = req.state_slot
        if finished and slot is not None:
            req.state_slot = None
            if req.computed == n and n not in ck:
                ck[n] = slot
            else:  # the state is not at the cached end: nothing to keep it for
                self.ledger.free_device(self.ckpt.index, (slot,))
        return ck

    # ------------------------------------------------------------------ the host tier's loads
    def wait_layer(self, layer_id: int) -> None:
        """Block until every pending host load has copied `layer_id` (the forward's hook)."""
        if self.host is not None:
            self.host.wait_layer(layer_id)

    def sync_loads(self) -> None:
        """Wait for every pending host load to end."""
        if self.host is not None:
            self.host.sync()

    def write_through(self, node, min_hits: int | None = None) -> int:
        return 0 if self.host is None else self.host.write_through(node, min_hits)

    # ------------------------------------------------------------------ sessions and admin
    def close_session(self, session_id) -> bool:
        return self.tree.close_session(session_id)

    def flush(self) -> bool:
        """Drop everything cached. Refused (False) while requests hold locks."""
        tree = self.tree
        if any(tree.locked) or any(tree.host_locked):
            return False
        self.sync_loads()
        rest = [0] * (len(self.pools) - 1)
        while True:  # host-only parents can go only once their children have gone, and back
            n = tree.num_nodes
            if self.host is not None:
                self.ledger.free(tree.evict_counts([tree.host_size[0] + 1] + rest, host=True))
            self.ledger.free(tree.evict_counts([tree.size[0] + 1] + rest))
            if not tree.num_nodes or tree.num_nodes == n:
                break
        for sid in list(tree.sessions):
            tree.close_session(sid)
        return True

    def stats(self) -> dict:
        t = self.tree.stats()
        for c, pool in zip(self.comps, self.pools):
            t["components"][c.name]["pool_available"] = pool.available
            t["components"][c.name]["pool_size"] = getattr(pool, "size", None)
        if self.host is not None:
            for c, hp in zip(self.comps, self.host.pools):
                t["components"][c.name]["host_pool_available"] = hp.available
                t["components"][c.name]["host_pool_size"] = hp.size
            t["host"] = self.host.stats(self.names)
        t["requests"] = self.requests
        t["prompt_tokens"] = self.prompt_tokens
        t["hit_tokens"] = self.hit_tokens
        t["hit_rate"] = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return t
