"""UnifiedRadixCache: the one object an engine talks to.

The tree decides which handles to keep, reuse or evict; this class executes: it owns
the pools, allocates (evicting on shortfall), frees what the tree gives back, copies
MAMBA checkpoints into request-owned slots (copy-on-write), and keeps the counts.

With host pools (L2) it also moves data between the tiers: it loads what a match needs
from the host (all or nothing, layer by layer under the forward), writes device data to
the host as the write policy says (`write_through`, `write_through_selective` after an
access-count threshold, `write_back` when it leaves the device), and frees host handles
the tree gives back.
"""
from __future__ import annotations

from array import array

from .hicache.transfer import CopyJob, LayerwiseLoad
from .memory.host import copy_handles
from .tree import CheckpointComponent, LockReceipt, RadixTree, encode
from .tree.keys import check_priority, check_session_id, salt_key
from .tree.component import page_floor

_NEG = array("i", (-1,))

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


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
    `host_tokens` of the prefix came from the host tier (a load the forward waits for).
    `staged`: host copies of pages it read from L3 through the host tier, its own until
    it is cached; then they become the tree's host copies of those pages.
    """

    __slots__ = ("key", "salt", "priority", "prefix_len", "matched", "pages", "receipt", "node",
                 "state_slot", "state_len", "checkpoints", "window_freed", "done", "cached_tokens",
                 "resume_points", "host_tokens", "staged")

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
        self.host_tokens = 0  # of prefix_len, FULL tokens loaded from the host tier
        self.staged: dict | None = None  # {ci: {page: (device, host)}}: L3 data read via the host

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

    def __init__(self, tree: RadixTree, pools: dict, copy_checkpoints: bool = True,
                 host_pools: dict | None = None, write_policy: str = "write_through",
                 write_through_threshold: int = 2):
        missing = [n for n in tree.names if n not in pools]
        if missing:
            raise ValueError(f"no pool for component(s) {missing}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; choose one of {', '.join(WRITE_POLICIES)}")
        if write_through_threshold < 1:
            raise ValueError(f"write_through_threshold must be at least 1, got {write_through_threshold}")
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
        self.host_pools = None
        self.write_policy = write_policy
        self.write_min_hits = write_through_threshold if write_policy == "write_through_selective" else 0
        self.pending_loads: list = []  # layer-by-layer loads the next reader of the pools waits for
        # write_back to the tier below the host: called with (node, ci) before a host-only
        # slot is evicted (the engine sets it when it has L3)
        self.host_evict_hook = None
        self.host_counters = dict(loads=0, loaded_handles=0, failed_loads=0, written_handles=0,
                                  skipped_writes=0, written_back=0, staged_from_storage=0, adopted=0)
        if host_pools is not None:
            missing = [n for n in tree.names if n not in host_pools]
            if missing:
                raise ValueError(f"no host pool for component(s) {missing}")
            self.host_pools = [host_pools[n] for n in tree.names]
            ids = set()
            for p in self.pools:
                ids.update(getattr(p, "layer_ids", ()))
            self.layer_ids = sorted(ids)

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
        tree = self.tree
        for ci, k in enumerate(short):
            if k > tree.size[ci] - tree.locked[ci]:  # evicting could not make room: evict nothing
                name = self.names[ci]
                raise CacheFull(
                    f"cannot allocate {need[ci]} {name} handles: {pools[ci].available} free and "
                    f"{tree.evictable(name)} evictable; the rest is locked by running requests")
        got: list = [None] * len(need)
        nc = len(need)
        outs = self._evict_device(short)
        for ci, h in enumerate(outs[:nc]):
            k = need[ci]
            if k and h:
                got[ci] = h[:k]
                h = h[k:]
            if h:
                pools[ci].free(h)
        self._free_host(outs[nc:])
        for ci, k in enumerate(need):
            have = 0 if got[ci] is None else len(got[ci])
            if pools[ci].available < k - have:
                for cj, h in enumerate(got):
                    if h:
                        pools[cj].free(h)
                name = self.names[ci]
                raise CacheFull(
                    f"cannot allocate {k} {name} handles: {pools[ci].available + have} free after "
                    f"evicting what the tree could give up; the rest of the {pools[ci].size} is held "
                    f"by running requests")
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
        self.sync_loads()
        ev = self.tree.evict(**targets)
        self._give_back(ev.freed)
        return ev

    def _evict_device(self, want: list[int]) -> list[array]:
        """tree.evict_counts for the device tier, with the host tier's backup hook."""
        self.sync_loads()  # a page being loaded is locked, but its copy must end before reuse
        return self.tree.evict_counts(want, backup=self._backup_hook)

    @property
    def _backup_hook(self):
        return self._back_up if self.host_pools is not None else None

    def _back_up(self, nd, ci: int):
        """The tree's backup hook, for a slot leaving the device with no host copy: with
        write_back, copy it to host handles (evicting host data to make room). Under the
        other policies only FULL of a node with children is copied: its children live on
        the host alone, and without a copy it could never leave the device. None when
        the slot goes without a copy."""
        if self.write_policy != "write_back" and not (ci == 0 and nd.children):
            return None
        v = nd.value[ci]
        need = [0] * len(self.pools)
        need[ci] = len(v)
        got = self._alloc_host(need)
        if got is None or not nd.attached or nd.value[ci] is not v:
            if got is not None:
                self.host_pools[ci].free(got[ci])
            self.host_counters["skipped_writes"] += len(v)
            return None
        copy_handles(self.pools[ci], v, self.host_pools[ci], got[ci])
        self.host_counters["written_back"] += len(v)
        return got[ci]

    def _free_host(self, host_outs) -> None:
        """Return host handles the tree gave back (by component index)."""
        if self.host_pools is None:
            return
        for ci, h in enumerate(host_outs):
            if h:
                self.host_pools[ci].free(h)

    def _free_outs(self, outs: list[array]) -> None:
        """Free a tree result list: device handles at [i], host ones at [nc + i]."""
        nc = len(self.pools)
        for ci, h in enumerate(outs[:nc]):
            if h:
                self.pools[ci].free(h)
        self._free_host(outs[nc:])

    def _alloc_host(self, need: list[int]) -> list | None:
        """Host handles per component, evicting host data on shortfall; None (nothing
        allocated) when the host tier cannot make room."""
        hps = self.host_pools
        short = [max(0, k - hp.available) for k, hp in zip(need, hps)]
        if any(short):
            self.sync_loads()
            # a node that goes whole gives back its device handles too
            self._free_outs(self.tree.evict_counts(short, host=True, backup=self.host_evict_hook))
            if any(k > hp.available for k, hp in zip(need, hps)):
                return None
        return [hp.alloc(k) if k else None for k, hp in zip(need, hps)]

    def evict(self, **targets: int):
        """Evict explicitly (e.g. to make room ahead of time), as a shortfall would (with
        the host tier's write-back); returns the EvictResult."""
        self.sync_loads()
        tree = self.tree
        ev = tree._evict_result(tree._targets(targets), False, self._backup_hook)
        self._give_back(ev.freed)
        return ev

    def _give_back(self, freed) -> None:
        """Free what the tree let go of: device handles, and host ones (`freed.host`)."""
        for name, h in freed.items():
            if h:
                self.pools[self.tree.index[name]].free(h)
        host = getattr(freed, "host", None)
        if host and self.host_pools is not None:
            for name, h in host.items():
                if h:
                    self.host_pools[self.tree.index[name]].free(h)

    # ------------------------------------------------------------------ request lifecycle
    def match_prefix(self, tokens, salt=None, priority: int | None = None,
                     alloc: bool = False) -> CachedRequest:
        """Match, lock what the match returns, and give the request a private copy of
        the checkpoint it resumes from. With `alloc`, also allocate the request's own
        pages for all of `tokens` in the same step (what alloc_request would do), so an
        eviction made for one component hands its other freed pages straight over.
        On CacheFull nothing stays locked or allocated."""
        check_priority(priority)  # before the tree sees them: a bad one fails here, nothing held
        salt_key(salt)
        key = tokens if isinstance(tokens, bytes) else encode(tokens)
        m = self.tree.match(key, salt, priority, lock=True)
        if m.loads:
            try:
                return self._start_request(key, m, salt, priority, alloc)
            except CacheFull:  # the host's part cannot come back now: reuse the device's
                self.host_counters["failed_loads"] += 1
                self._unlock(m.receipt)
                m = self.tree.match(key, salt, priority, lock=True, host=False)
            except BaseException:
                self._unlock(m.receipt)
                raise
        try:
            return self._start_request(key, m, salt, priority, alloc)
        except BaseException:
            self._unlock(m.receipt)
            raise

    def _start_request(self, key: bytes, m, salt, priority, alloc: bool) -> CachedRequest:
        """Allocate what the request needs (its own pages, its state slot, device room
        for the slots to load from the host) in one all-or-nothing step, start the
        load, and hand out the reused handles."""
        rc = m.receipt
        b = m.boundary
        P = self.page_size
        need = [0] * len(self.pools)
        for ci, nd in m.loads:
            need[ci] += len(nd.host[ci])
        want = -(-(len(key) >> 2) // P) if alloc else 0
        if want > b // P:
            for c in self.page_comps:
                need[c.index] += want - b // P
        if self.ckpt is not None:
            need[self.ckpt.index] += 1
        got = self._alloc(need) if any(need) else None
        handles = m.handles
        jobs = []
        if m.loads:
            jobs = self._load(m.loads, got)
            handles = self.tree.handles_at(m.node)
        pages = {}
        for c in self.page_comps:
            h = handles[c.name]
            if c.window is not None:
                h = _NEG * (b // P - len(h)) + h
            pages[c.name] = h
            own = got[c.index] if got is not None else None
            if own:
                pages[c.name] += own
        req = CachedRequest(key, salt, priority, b, m.matched, pages, rc, m.node)
        if m.loads:
            req.host_tokens = m.host_tokens
        if self.ckpt is not None:
            slot = got[self.ckpt.index][0]
            src = handles[self.ckpt.name]
            if src:
                ci = self.ckpt.index
                loaded = next((nd for cj, nd in m.loads if cj == ci), None)
                if loaded is not None:  # the private copy comes straight from the host
                    jobs.append(CopyJob(self.host_pools[ci], loaded.host[ci], self.pools[ci],
                                        array("i", (slot,))))
                elif self.copy_checkpoints:
                    self.pools[ci].copy_slot(src[0], slot)
                req.state_len = b
            req.state_slot = slot
        if jobs:
            self.pending_loads.append(LayerwiseLoad(jobs, self.layer_ids).start())
        self.requests += 1
        self.prompt_tokens += len(key) // 4
        self.hit_tokens += b
        return req

    def _load(self, loads, got: list) -> list:
        """Give every host-only slot of `loads` device handles from the front of
        `got[ci]` (the rest stays the request's), and return the copies that fill them
        (one job per component)."""
        src: dict[int, array] = {}
        dst: dict[int, array] = {}
        for ci, nd in loads:
            hh = nd.host[ci]
            n = len(hh)
            h = got[ci][:n]
            got[ci] = got[ci][n:]
            self.tree.set_device(nd, ci, h)
            src.setdefault(ci, array("i")).extend(hh)
            dst.setdefault(ci, array("i")).extend(h)
        self.host_counters["loads"] += 1
        self.host_counters["loaded_handles"] += sum(len(h) for h in dst.values())
        return [CopyJob(self.host_pools[ci], src[ci], self.pools[ci], dst[ci]) for ci in src]

    def stage_fetched(self, req: CachedRequest, got) -> bool:
        """Land data read from L3 (an `L3Store.fetch` result naming the request's own
        device handles) in the host tier, and load it from there into those handles layer
        by layer. The host copies of the pages stay the request's (`req.staged`) until it
        is cached. False, with nothing written, when the host cannot make room: then the
        caller writes the data to the device directly."""
        from .hicache.codec import write_handles, write_sidecar_rows
        index = {id(p): ci for ci, p in enumerate(self.pools)}
        need = [0] * len(self.pools)
        for target, hs, _, sidecar in got.plan:
            if not sidecar:
                need[index[id(target)]] += len(hs)
        hh = self._alloc_host(need)
        if hh is None:
            return False
        jobs = []
        staged = req.staged if req.staged is not None else {}
        host = None
        for (target, hs, _, sidecar), blobs in zip(got.plan, got.blobs):
            if sidecar:  # rows of the pool entry just before it, on the same handles
                write_sidecar_rows(host.sidecars[target.name], host_h, blobs)
                continue
            ci = index[id(target)]
            host = self.host_pools[ci]
            host_h = hh[ci][:len(hs)]
            hh[ci] = hh[ci][len(hs):]
            write_handles(host, host_h, blobs)
            jobs.append(CopyJob(host, host_h, target, array("i", hs)))
            if ci == getattr(self.ckpt, "index", -1):  # a state slot moves on: nothing to keep
                staged.setdefault(-1, []).extend(host_h)
                continue
            first = (got.b // self.page_size) - len(hs)
            pages = staged.setdefault(ci, {})
            for k, (d, h) in enumerate(zip(hs, host_h)):
                pages[first + k] = (d, h)
        req.staged = staged
        self.pending_loads.append(LayerwiseLoad(jobs, self.layer_ids).start())
        self.host_counters["staged_from_storage"] += sum(need)
        return True

    def _adopt_staged(self, req: CachedRequest, node) -> None:
        """The request is cached (or released: node None): the tree takes its staged host
        pages as host copies where they hold a node's data, the rest are freed."""
        staged, req.staged = req.staged, None
        if not staged:
            return
        if node is not None and node.parent is not None:
            self.write_through(node, staged=staged)
        for ci, pages in staged.items():
            if ci < 0:
                self.host_pools[self.ckpt.index].free(array("i", pages))
            elif pages:
                self.host_pools[ci].free(array("i", (h for _, h in pages.values())))

    def wait_layer(self, layer_id: int) -> None:
        """Block until every pending load has copied `layer_id` (the forward's hook)."""
        for ld in self.pending_loads:
            ld.wait(layer_id)

    def sync_loads(self) -> None:
        """Wait for every pending load to end (before device data is read other than by
        the forward, or a loaded page could be reused)."""
        if not self.pending_loads:
            return
        loads, self.pending_loads = self.pending_loads, []
        for ld in loads:
            ld.wait_all()

    def write_through(self, node, min_hits: int | None = None, staged: dict | None = None) -> int:
        """Give the device slots on the path to `node` that the host has no copy of a
        host copy (the write policy's L1 -> L2 step after a request is cached); with
        `write_through_selective` only on nodes accessed `write_through_threshold` times;
        with `write_back` nothing is copied here. `staged` ({ci: {page: (device, host)}}):
        host pages that already hold a slot's data (read from L3 through the host): they
        are taken as they are, whatever the policy, and removed from `staged`. Returns the
        handles copied; none when the host cannot make room."""
        if self.host_pools is None or not node.attached:
            return 0
        copying = self.write_policy != "write_back"
        hits = self.write_min_hits if min_hits is None else min_hits
        P = self.page_size
        todo, need = [], [0] * len(self.pools)
        for ci, nd in self.tree.unbacked(node):
            v = nd.value[ci]
            pages = staged.get(ci) if staged else None
            have = None
            if pages:
                first = nd.start // P
                have = array("i", (x[1] if x is not None and x[0] == d else -1
                                   for x, d in zip((pages.get(first + k) for k in range(len(v))), v)))
            missing = len(v) if have is None else have.count(-1)
            if missing and (not copying or nd.hits < hits):
                continue
            todo.append((ci, nd, have))
            need[ci] += missing
        if not todo:
            return 0
        self.sync_loads()
        rc = self.tree.lock(node)  # a host eviction to make room must not take this path
        src: dict[int, array] = {}
        dst: dict[int, array] = {}
        try:
            got = self._alloc_host(need) if any(need) else [None] * len(need)
            if got is None:
                self.host_counters["skipped_writes"] += sum(need)
                todo = [t for t in todo if t[2] is not None and -1 not in t[2]]
                got = [None] * len(need)
            for ci, nd, have in todo:
                v = nd.value[ci]
                if have is None:
                    have = _NEG * len(v)
                n = have.count(-1)
                h = got[ci][:n] if n else array("i")
                if n:
                    got[ci] = got[ci][n:]
                if not nd.attached or nd.host[ci] is not None or nd.value[ci] is not v:
                    if n:  # gone or changed while making room
                        self.host_pools[ci].free(h)
                    continue
                k = 0
                for i, x in enumerate(have):
                    if x < 0:
                        have[i] = h[k]
                        src.setdefault(ci, array("i")).append(v[i])
                        k += 1
                dst.setdefault(ci, array("i")).extend(h)
                self.tree.set_host(nd, ci, have)
                if staged and ci in staged:
                    first = nd.start // P
                    pages = staged[ci]
                    for i in range(len(v)):
                        pages.pop(first + i, None)
                    self.host_counters["adopted"] += len(v) - n
            for ci in src:
                copy_handles(self.pools[ci], src[ci], self.host_pools[ci], dst[ci])
        finally:
            self._unlock(rc)
        n = sum(len(h) for h in dst.values())
        self.host_counters["written_handles"] += n
        return n

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
        check_session_id(session_id)  # before the insert: a bad id changes nothing
        node, _ = self._insert(req, finished=True)
        self._unlock(req.receipt)
        req.done = True
        if session_id is not None and node.parent is not None:
            self.tree.register_session(session_id, node)
        if req.staged is not None:
            self._adopt_staged(req, node)  # writes through the rest too
        elif self.host_pools is not None and node.parent is not None:
            self.write_through(node)
        return node

    def release(self, req: CachedRequest) -> None:
        """Abort: free everything the request owns and unlock, caching nothing."""
        self.sync_loads()  # a load may still be writing its state slot
        if req.staged is not None:
            self._adopt_staged(req, None)
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
        if any(r.outs):
            self._free_outs(r.outs)
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
        if any(self.tree.locked) or any(self.tree.host_locked):
            return False
        self.sync_loads()
        tree = self.tree
        while True:  # host-only parents can go only once their children have gone, and back
            n = tree.num_nodes
            if self.host_pools is not None:
                self._free_outs(tree.evict_counts([tree.host_size[0] + 1] + [0] * (len(self.pools) - 1),
                                                  host=True))
            self._evict(**{c.evict_kw: tree.size[c.index] + 1 for c in self.comps[:1]})
            if not tree.num_nodes or tree.num_nodes == n:
                break
        for sid in list(self.tree.sessions):
            self.tree.close_session(sid)
        return True

    def stats(self) -> dict:
        t = self.tree.stats()
        for c, pool in zip(self.comps, self.pools):
            t["components"][c.name]["pool_available"] = pool.available
            t["components"][c.name]["pool_size"] = getattr(pool, "size", None)
        if self.host_pools is not None:
            for c, hp in zip(self.comps, self.host_pools):
                t["components"][c.name]["host_pool_available"] = hp.available
                t["components"][c.name]["host_pool_size"] = hp.size
            t["host"] = dict(self.host_counters, write_policy=self.write_policy)
        t["requests"] = self.requests
        t["prompt_tokens"] = self.prompt_tokens
        t["hit_tokens"] = self.hit_tokens
        t["hit_rate"] = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return t
