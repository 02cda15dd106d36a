"""Where handles change hands: allocation that evicts on shortfall, in either tier, and
the only place handles go back to their pools. The tree plans each eviction slot by
slot; this carries the plans out, asking the host tier (when there is one) to copy down
what should survive and to write down what the host is about to lose."""
from __future__ import annotations

from array import array

from ..tree import COPY_DOWN, LOSE, Freed, RadixTree


class CacheFull(RuntimeError):
    """The pools cannot hold what was asked even after evicting everything unlocked."""


class Ledger:
    """tree: the RadixTree; pools: device pools by component index; host: the host
    tier (hicache.l2.HostTier) or None. A pool is anything with alloc(n) ->
    array('i'), free(handles), `available` and `size`."""

    def __init__(self, tree: RadixTree, pools: list, host=None) -> None:
        self.tree = tree
        self.pools = pools
        self.host = host
        self.names = tree.names
        #: component index -> free handles spares may not take (spare windows: the last
        #: share of a window pool stays free for what allocates without evicting, the
        #: drafts of a verify step)
        self.spare_reserve: dict[int, int] = {}

    # ------------------------------------------------------------------ freeing
    def free(self, freed: Freed | None) -> None:
        """Give back what the tree let go of, in both tiers."""
        if freed is None:
            return
        for pool, h in zip(self.pools, freed.device):
            if h:
                pool.free(h)
        if self.host is not None:
            for pool, h in zip(self.host.pools, freed.on_host):
                if h:
                    pool.free(h)

    def free_device(self, ci: int, handles) -> None:
        if handles:
            self.pools[ci].free(handles if isinstance(handles, array) else array("i", handles))

    def free_host(self, ci: int, handles) -> None:
        if handles:
            self.host.pools[ci].free(handles if isinstance(handles, array) else array("i", handles))

    # ------------------------------------------------------------------ the device tier
    def alloc(self, need: list[int], evict: bool = True) -> list:
        """Device handles per component index, evicting unlocked data on shortfall (with
        `evict` False: from the free handles alone, CacheFull when they are short). All or
        nothing: raises CacheFull and allocates nothing when locked data leaves too
        little. Handles an eviction frees for a component being allocated go straight to
        the caller (tree -> request: they stay allocated), so only the excess returns."""
        pools = self.pools
        if evict and self.spare_reserve:
            for ci, r in self.spare_reserve.items():
                k = need[ci]
                if k and pools[ci].available - k < r:
                    self.free(self.evict_spares(ci, r - pools[ci].available + k))
        short = None
        for ci, k in enumerate(need):
            if k:
                gap = k - pools[ci].available
                if gap > 0:
                    if short is None:
                        short = [0] * len(need)
                    short[ci] = gap
        if short is None:
            return [pools[ci].alloc(k) if k else None for ci, k in enumerate(need)]
        if not evict:
            ci = next(ci for ci, k in enumerate(short) if k)
            raise CacheFull(f"{need[ci]} {self.names[ci]} handles asked for without evicting; "
                            f"{pools[ci].available} free")
        tree = self.tree
        for ci, k in enumerate(short):
            if k and k > tree.size[ci] - tree.locked[ci]:  # evicting could not make room: evict nothing
                raise CacheFull(
                    f"cannot allocate {need[ci]} {self.names[ci]} handles: {pools[ci].available} free and "
                    f"{tree.evictable(self.names[ci])} evictable; the rest is locked by running requests")
        freed = self.evict_device(short)
        evicted = freed.device
        got: list = [None] * len(need)
        rest = list(need)  # what the pools still give, once the evicted handles are taken
        for ci, k in enumerate(need):
            if k and evicted[ci]:
                h = evicted[ci]
                got[ci], evicted[ci] = h[:k], h[k:]
                rest[ci] = k - len(got[ci])
        self.free(freed)
        for ci, k in enumerate(rest):
            if k and pools[ci].available < k:
                have = need[ci] - k
                for cj, h in enumerate(got):
                    if h:
                        pools[cj].free(h)
                raise CacheFull(
                    f"cannot allocate {need[ci]} {self.names[ci]} handles: {pools[ci].available + have} free "
                    f"after evicting what the tree could give up; the rest of the {pools[ci].size} is held "
                    f"by running requests")
        for ci, k in enumerate(rest):
            if k:
                if got[ci] is None:
                    got[ci] = pools[ci].alloc(k)
                else:
                    got[ci] += pools[ci].alloc(k)
        return got

    def evict_device(self, want: list[int]) -> Freed:
        """Carry out the tree's plans until `want[ci]` device handles per component went
        (or nothing more can): a slot to copy down is offered to the host tier first
        (without one, nothing is copied: the tree's evict_counts). The freed handles are
        returned, not yet given back."""
        tree, host = self.tree, self.host
        if host is None:
            return tree.evict_counts(want)
        host.sync()  # a page being loaded is locked, but its copy must end before reuse
        freed = tree.freed()
        for ci, k in enumerate(want):
            out = freed.device[ci]
            while len(out) < k:
                ev = tree.next_eviction(ci)
                if ev is None:
                    break
                copy = host.copy_down(ev) if ev.fate == COPY_DOWN else None
                tree.carry_out(ev, freed, copy)
        return tree.finish_eviction(freed)

    def evict_spares(self, ci: int, k: int) -> Freed:
        """At least `k` device handles of component ci from its spare slots alone (fewer
        when the spares run out); nothing is copied down. Returned, not yet given back."""
        tree = self.tree
        if self.host is not None:
            self.host.sync()
        freed = tree.freed()
        out = freed.device[ci]
        while len(out) < k:
            ev = tree.next_eviction(ci, spare_only=True)
            if ev is None:
                break
            tree.carry_out(ev, freed)
        return tree.finish_eviction(freed)

    def evict(self, want: list[int]) -> Freed:
        """Evict explicitly (to make room ahead of time), as a shortfall would; the freed
        handles are given back and returned for the count."""
        freed = self.evict_device(want)
        self.free(freed)
        return freed

    # ------------------------------------------------------------------ the host tier
    def alloc_host(self, need: list[int]) -> list | None:
        """Host handles per component index, evicting host data on shortfall; None
        (nothing allocated) when the host tier cannot make room."""
        hps = self.host.pools
        short = [max(0, k - hp.available) for k, hp in zip(need, hps)]
        if any(short):
            self.free(self.evict_host(short))  # a node that goes whole gives back its device handles too
            if any(k > hp.available for k, hp in zip(need, hps)):
                return None
        return [hp.alloc(k) if k else None for k, hp in zip(need, hps)]

    def evict_host(self, want: list[int]) -> Freed:
        """The host tier's plans: what only the host holds is offered to the tier below
        before it is lost (write_back)."""
        tree, host = self.tree, self.host
        host.sync()
        freed = tree.freed()
        for ci, k in enumerate(want):
            out = freed.on_host[ci]
            while len(out) < k:
                ev = tree.next_eviction(ci, host=True)
                if ev is None:
                    break
                if ev.fate == LOSE:
                    host.write_down(ev)
                tree.carry_out(ev, freed)
        return tree.finish_eviction(freed)
