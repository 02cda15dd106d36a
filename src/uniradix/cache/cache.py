"""UnifiedRadixCache: the one object an engine talks to.

The tree decides which handles to keep, reuse or evict; the cache executes: it owns the
pools, allocates (evicting on shortfall, through the ledger), frees what the tree gives
back, and copies MAMBA checkpoints into request-owned slots (copy-on-write). With host
pools it has a host tier (hicache.l2.HostTier) that loads what a match needs from the
host and copies down what the write policy says."""
from __future__ import annotations

from array import array

from ..config import HostTierConfig
from ..hicache.l2 import HostTier
from ..hicache.transfer import CopyJob
from ..tree import RadixTree, encode
from ..tree.keys import check_priority, salt_key
from .finishing import Finishing
from .handles import CacheFull, Ledger
from .request import RequestState
from .running import Running

_NEG = array("i", (-1,))

_HOST = HostTierConfig()  # the defaults, declared once in config

#: spare windows never fill the last 1/SPARE_RESERVE of their pool: what allocates
#: without evicting anything cached (a verify step's drafts) finds it free
SPARE_RESERVE = 8


class UnifiedRadixCache(Running, Finishing):
    """tree: a RadixTree over the model's components; pools: per component name, an
    object with alloc(n) -> array('i'), free(handles) and `available` (and copy_slot for
    a checkpoint component; without it, as with accounting-only allocators, nothing is
    copied). host_pools: the host tier's mirrors by name (L2), or None."""

    def __init__(self, tree: RadixTree, pools: dict, copy_checkpoints: bool = True,
                 host_pools: dict | None = None, write_policy: str = _HOST.hicache_write_policy,
                 write_through_threshold: int = _HOST.write_through_threshold):
        missing = [n for n in tree.names if n not in pools]
        if missing:
            raise ValueError(f"no pool for component(s) {missing}")
        settings = HostTierConfig(hicache_write_policy=write_policy,  # checked where they are declared
                                  write_through_threshold=write_through_threshold)
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
        #: windowed KV a prompt leaves behind stays in the tree as spares (keep_spare)
        self.spare_windows = any(c.keep_spare for c in self.windowed)
        self.copy_checkpoints = copy_checkpoints and self.ckpt is not None and \
            hasattr(self.pools[self.ckpt.index], "copy_slot")
        self._one_slot = [0] * len(self.pools)  # add_checkpoint's need
        if self.ckpt is not None:
            self._one_slot[self.ckpt.index] = 1
        self.requests = self.prompt_tokens = self.hit_tokens = 0
        self.write_policy = write_policy
        self.write_min_hits = settings.write_min_hits
        self.host = None
        if host_pools is not None:
            missing = [n for n in tree.names if n not in host_pools]
            if missing:
                raise ValueError(f"no host pool for component(s) {missing}")
            self.host = HostTier(tree, self.pools, [host_pools[n] for n in tree.names], write_policy,
                                 self.write_min_hits, self.ckpt.index if self.ckpt else None)
        self.ledger = Ledger(tree, self.pools, self.host)
        for c in self.windowed:  # spares never take the last SPARE_RESERVE share of their pool
            if c.keep_spare:
                self.ledger.spare_reserve[c.index] = -(-self.pools[c.index].size // SPARE_RESERVE)
        if self.host is not None:
            self.host.ledger = self.ledger
        self.lower = None  # the storage tier (set by it): takes what a flush is about to drop

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
                     state: RequestState | None = None, windows: int | None = None) -> RequestState:
        """Match, lock what the match returns, and give the request a private copy of
        the checkpoint it resumes from (into `state`, or a new RequestState). With `alloc`,
        also allocate the request's own pages for all of `tokens` in the same step, so an
        eviction made for one component hands its other freed pages straight over; the
        windowed components' only for its first `windows` tokens when given (0: none past
        the reused prefix; an engine takes them chunk by chunk, `alloc_window`). What
        only the host holds is loaded back (all or nothing; else the request resumes at
        the device's boundary). On CacheFull nothing stays locked or allocated."""
        if priority is not None:  # before the tree sees them: a bad one fails here, nothing held
            check_priority(priority)
        if salt is not None:
            salt_key(salt)
        key = tokens if isinstance(tokens, bytes) else encode(tokens)
        if state is None:
            state = RequestState(salt=salt, priority=priority)
        m = self.tree.match(key, salt, priority, lock=True)
        if m.loads:
            try:
                return self._start(state, key, m, salt, priority, alloc, windows)
            except CacheFull:  # the host's part cannot come back now: reuse the device's
                self.host.counters["failed_loads"] += 1
                self._unlock(m.receipt)
                m = self.tree.match(key, salt, priority, lock=True, host=False)
            except BaseException:
                self._unlock(m.receipt)
                raise
        try:
            return self._start(state, key, m, salt, priority, alloc, windows)
        except BaseException:
            self._unlock(m.receipt)
            raise

    def _start(self, state: RequestState, key: bytes, m, salt, priority, alloc: bool,
               windows: int | None) -> RequestState:
        """Allocate what the request needs (its own pages, its state slot, device room
        for the slots to load from the host) in one all-or-nothing step, start the
        load, and hand out the reused handles."""
        b, P, loads, ckpt = m.boundary, self.page_size, m.loads, self.ckpt
        ntokens = len(key) >> 2
        need = [0] * len(self.pools)
        for ci, nd in loads:
            need[ci] += len(nd.host[ci])
        own_pages = -(-ntokens // P) - b // P if alloc else 0
        own_windows = own_pages if windows is None else min(own_pages, -(-windows // P) - b // P)
        for c in self.page_comps:
            need[c.index] += max(0, own_pages if c.window is None else own_windows)
        if ckpt is not None:
            need[ckpt.index] += 1
        got = self.ledger.alloc(need) if any(need) else None
        handles, jobs = m.handles, []
        if loads:
            jobs = self.host.load(loads, got)
            handles = self.tree.handles_at(m.node)
        pages = {}
        for c in self.page_comps:
            h = handles[c.name]
            if c.window is not None:  # -1 for the pages before the window
                h = _NEG * (b // P - len(h)) + h
            own = got[c.index] if got is not None else None
            pages[c.name] = h + own if own else h
        state.key, state.salt, state.priority = key, salt, priority
        state.prefix_len = state.reused = state.computed = b
        state.junction, state.pages, state.receipt, state.node = m.matched, pages, m.receipt, m.node
        state.host_tokens = m.host_tokens if loads else 0
        state.held = True
        if ckpt is not None:
            jobs += self._private_state(state, m, handles, got)
        if jobs:
            self.host.start(jobs)
        self.requests += 1
        self.prompt_tokens += ntokens
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

    def reusable(self, tokens, salt=None) -> int:
        """The boundary `match_prefix(tokens, salt)` would resume at now (host data
        included), changing nothing: no lock, no split, no access counted."""
        return self.tree.reusable(tokens, salt)

    def zero_state(self, state: RequestState) -> None:
        """A request that resumes from nothing starts from a zero recurrent state."""
        if state.state_slot is not None and state.prefix_len == 0 and hasattr(self.pools[self.ckpt.index],
                                                                               "zero_slots"):
            self.pools[self.ckpt.index].zero_slots([state.state_slot])

    # ------------------------------------------------------------------ a request runs

    # ------------------------------------------------------------------ a request ends

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
    def close_session(self, session_id, salt=None) -> bool:
        """Drop the references of session `session_id` opened under `salt` (its tenant)."""
        return self.tree.close_session(session_id, salt)

    def flush(self, write_down: bool = True) -> bool:
        """Drop everything cached, after the storage tier below (`lower`) wrote down what
        it lacks (hicache.l3.StorageTier.write_down: bounded in time; `write_down=False`:
        the caller did it already). Refused (False) while requests hold locks."""
        tree = self.tree
        if any(tree.locked) or any(tree.host_locked):
            return False
        self.sync_loads()
        if self.lower is not None and write_down:
            self.lower.write_down()
        s = tree.structural.index  # evicting all of it takes every node with it
        while True:  # host-only parents can go only once their children have gone, and back
            n = tree.num_nodes
            want = [0] * len(self.pools)
            if self.host is not None:
                want[s] = tree.host_size[s] + 1
                self.ledger.free(tree.evict_counts(want, host=True))
            want[s] = tree.size[s] + 1
            self.ledger.free(tree.evict_counts(want))
            if not tree.num_nodes or tree.num_nodes == n:
                break
        tree.close_all_sessions()
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
