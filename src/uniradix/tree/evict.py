"""Eviction: the tree decides what goes, one slot at a time, and says what becomes of
it; the tier that owns the memory carries it out.

`next_eviction(ci, host)` pops the best-ranked evictable slot of one component in one
tier and returns its plan, an `Eviction`: `fate` says whether only this tier's copy goes
(the other tier keeps one: DROP_COPY), whether it survives only if the tier copies it
down first (COPY_DOWN: no copy below; FULL over host-only children must be copied, any
other slot may be under write_back), or whether its last copy goes (LOSE: a tombstone,
or the whole leaf). The tier copies what it keeps, then `carry_out` applies the plan;
`finish_eviction` lists again what had to stay. The tree never calls out in between, and
a caller without a lower tier uses `evict` / `evict_counts`, which copy nothing."""
from __future__ import annotations

from array import array

from .node import Node
from .results import EvictResult, Freed

DROP_COPY, COPY_DOWN, LOSE = "drop_copy", "copy_down", "lose"


class Eviction:
    """One slot's plan: slot (`node`, `ci`) of the device tier (or the host tier, `host`)
    holding `value` leaves it as `fate` says. `must_copy`: it cannot go without a copy
    below (FULL over host-only children)."""

    __slots__ = ("node", "ci", "host", "value", "fate", "must_copy")

    def __init__(self, node: Node, ci: int, host: bool, fate: str, must_copy: bool = False):
        self.node, self.ci, self.host, self.fate, self.must_copy = node, ci, host, fate, must_copy
        self.value = node.host[ci] if host else node.value[ci]

    def __repr__(self) -> str:
        return f"Eviction({self.node!r}, ci={self.ci}, host={self.host}, {self.fate})"


class Evicting:
    """RadixTree's eviction (a mixin: the state lives on the tree)."""

    # ------------------------------------------------------------------ lists
    @staticmethod
    def _evictable(ci: int, nd: Node, host: bool) -> bool:
        """Whether one tier may let go of slot (nd, ci) now. FULL shapes the tree: an
        internal node keeps it unless the other tier holds a copy, or (device tier) no
        child holds FULL on the device any more, so that a copy down can take it."""
        if host:
            v, other = nd.host[ci], nd.value[ci]
        else:
            v, other = nd.value[ci], nd.host[ci]
        if v is None or not nd.attached or nd.locks[ci]:
            return False
        if ci or not nd.children or other is not None:
            return True
        if host:
            return False
        for ch in nd.children.values():
            if ch.value[0] is not None:
                return False
        return True

    def _place(self, ci: int, nd: Node, host: bool = False) -> None:
        """List slot (nd, ci) of one tier if it is evictable now. Entries that stop being
        evictable (locked, given children, dropped) are left in place and skipped at
        pop; a node removed from the tree leaves every list (_remove)."""
        if self._evictable(ci, nd, host):
            (self.host_lists if host else self.lists)[ci].place(
                nd, 2 if nd.refs[ci] else 3 if nd.spare >> ci & 1 else 1)  # referenced, spare, plain

    def _pop(self, ci: int, host: bool = False, spare_only: bool = False):
        """The next evictable slot of component ci in one tier, dropping stale entries."""
        lst = (self.host_lists if host else self.lists)[ci]
        while True:
            nd = lst.pop(spare_only)
            if nd is None or self._evictable(ci, nd, host):
                return nd

    def _place_all(self, nd: Node) -> None:
        if nd.parent is None:
            return
        for ci in range(self.nc):
            self._place(ci, nd)
            if self.hosted:
                self._place(ci, nd, True)

    def evictable(self, name: str, host: bool = False) -> int:
        i = self.index[name]
        if host:
            return self.host_size[i] - self.host_locked[i]
        return self.size[i] - self.locked[i]

    def freed(self) -> Freed:
        """An empty result for handles the tree lets go of (device and host, per component)."""
        return Freed(self.names)

    # ------------------------------------------------------------------ the plan, slot by slot
    def next_eviction(self, ci: int, host: bool = False, spare_only: bool = False) -> Eviction | None:
        """Pop the next slot of component ci in one tier and say what becomes of it;
        None when nothing of it is evictable (with `spare_only`, no spare is). Apply
        with carry_out."""
        nd = self._pop(ci, host, spare_only)
        if nd is None:
            return None
        if host:
            return Eviction(nd, ci, True, DROP_COPY if nd.value[ci] is not None else LOSE)
        if nd.host[ci] is not None:
            return Eviction(nd, ci, False, DROP_COPY)
        if nd.spare >> ci & 1:  # a spare costs only room that would stand empty: never copied down
            return Eviction(nd, ci, False, LOSE)
        return Eviction(nd, ci, False, COPY_DOWN, ci == 0 and bool(nd.children))

    def carry_out(self, ev: Eviction, freed: Freed, copy: array | None = None) -> None:
        """Apply a plan: `copy` is the host handles a COPY_DOWN slot was copied into (the
        host keeps them; None: not copied). Handles let go of go to `freed`. A slot that
        changed since it was planned (gone, or taken by a lower-tier eviction meanwhile)
        is left alone; its copy, if any, is handed back in `freed`."""
        nd, ci, host = ev.node, ev.ci, ev.host
        cur = nd.host[ci] if host else nd.value[ci]
        if not nd.attached or cur is not ev.value or nd.locks[ci]:
            if copy is not None:
                freed.on_host[ci] += copy
            self._place(ci, nd, host)
            return
        self._let_go(nd, ci, host, freed, copy)

    def _let_go(self, nd: Node, ci: int, host: bool, freed: Freed, copy: array | None = None) -> None:
        """Slot (nd, ci) of one tier goes, evictable as it is now (carry_out's plan, or
        straight from the list when nothing is copied down)."""
        if host:
            if nd.value[ci] is not None:  # the device keeps it: only the copy goes
                self._drop(nd, ci, True, freed.on_host[ci])
                return
        else:
            if copy is not None and nd.host[ci] is None:
                self._attach(nd, ci, copy, True)
            if nd.host[ci] is not None:  # the host keeps it: the node stays
                self.offloaded[ci] += len(nd.value[ci])
                self._drop(nd, ci, False, freed.device[ci])
                return
            if ci == 0 and nd.children:
                self._kept.append(nd)  # over host-only children and not copied: it stays
                return
        # the slot's last copy goes
        if ci == 0 or not (nd.children or any(nd.locks)):
            parent = nd.parent
            self._remove(nd, freed)
            self._prune_up(parent, freed)
        else:  # internal, or a leaf whose other data is locked: only this slot goes
            self._tombstone(nd, ci, freed)

    def finish_eviction(self, freed: Freed) -> Freed:
        """After a run of carry_out: list again what had to stay, count what went."""
        if self._kept:
            kept, self._kept = self._kept, []
            for nd in kept:
                self._place(0, nd)
        for ci, h in enumerate(freed.device):
            self.evicted[ci] += len(h)
        if any(freed.on_host):
            for ci, h in enumerate(freed.on_host):
                self.host_evicted[ci] += len(h)
        return freed

    # ------------------------------------------------------------------ without a lower tier
    def evict(self, **targets: int) -> EvictResult:
        """Free at least the given number of device handles per component, e.g.
        evict(full_pages=64, swa_pages=16, mamba_slots=1); less when only locked data is left.
        A slot the host holds a copy of only leaves the device (the node stays,
        host-only). Otherwise internal SWA/MAMBA slots become tombstones; a leaf that can
        no longer serve a valid boundary goes whole, and its parent is checked in turn.
        Nothing is copied down (a tier that copies runs the plan itself)."""
        return self._evict_result(self._targets(targets), False)

    def evict_host(self, **targets: int) -> EvictResult:
        """evict() for the host tier: a slot the device also holds loses only its host
        copy; a host-only slot is lost as a device slot would be."""
        return self._evict_result(self._targets(targets), True)

    def _targets(self, targets: dict) -> list[int]:
        want = [0] * self.nc
        for k, v in targets.items():
            ci = self.evict_kws.get(k)
            if ci is None:
                ci = self.index.get(k)
                if ci is None:
                    raise ValueError(f"unknown eviction target {k!r}; expected one of {sorted(self.evict_kws)}")
            if v < 0:
                raise ValueError(f"eviction target {k} must be >= 0, got {v}")
            want[ci] = v
        return want

    def _evict_result(self, want: list[int], host: bool) -> EvictResult:
        removed0, tomb0 = self.removed_nodes, sum(self.tombstones)
        freed = self.evict_counts(want, host)
        return EvictResult(freed, self.removed_nodes - removed0, sum(self.tombstones) - tomb0)

    def evict_counts(self, want: list[int], host: bool = False) -> Freed:
        """evict() (or evict_host()) by component index, copying nothing down."""
        freed = self.freed()
        for ci, k in enumerate(want):
            if not k:
                continue
            out = freed.on_host[ci] if host else freed.device[ci]
            while len(out) < k:  # nothing to copy down: no plan to make, each slot goes as popped
                nd = self._pop(ci, host)
                if nd is None:
                    break
                self._let_go(nd, ci, host, freed)
        return self.finish_eviction(freed)

    # ------------------------------------------------------------------ what going means
    def _drop(self, nd: Node, ci: int, host: bool, out: array) -> None:
        """One tier lets go of a slot the other tier still holds."""
        if host:
            v = nd.host[ci]
            nd.host[ci] = None
            self.host_size[ci] -= len(v)
        else:
            v = nd.value[ci]
            nd.value[ci] = None
            self.size[ci] -= len(v)
        out += v
        self._place(ci, nd, not host)  # FULL: the other tier's copy may no longer go
        if ci == 0 and not host and nd.parent.parent is not None:
            self._place(0, nd.parent)  # the parent may be the device's leaf now

    def _remove(self, nd: Node, freed: Freed) -> None:
        """Detach a leaf and free all its data, in both tiers."""
        value, size, dev = nd.value, self.size, freed.device
        for ci in range(self.nc):
            v = value[ci]
            if v is not None:
                dev[ci] += v
                size[ci] -= len(v)
                value[ci] = None
        if self.hosted:  # before any host copy, every host slot is None
            host, hst = nd.host, freed.on_host
            for ci in range(self.nc):
                h = host[ci]
                if h is not None:
                    hst[ci] += h
                    self.host_size[ci] -= len(h)
                    host[ci] = None
        parent = nd.parent
        del parent.children[nd.key[:self.unit]]
        nd.attached = False
        if self.drafts is not None:
            self.drafts.remove(nd)
        where, nc = nd.where, self.nc
        for slot, tier in enumerate(where):  # out of every list now: a list popped seldom (a pool
            if tier:                         # rarely short) would otherwise keep removed nodes for good
                (self.lists if slot < nc else self.host_lists)[slot % nc].place(nd, 0)
        self.removed_nodes += 1
        self.num_nodes -= 1
        if parent.parent is not None:
            if not parent.children:
                self._place(0, parent)
                if self.hosted:
                    self._place(0, parent, True)
            elif self.hosted:  # its last child with device FULL may have gone
                self._place(0, parent)

    def _prune_up(self, nd: Node, freed: Freed) -> Node:
        """Remove nd and its ancestors while each is an unlocked useless leaf; returns
        the deepest node that stays."""
        while nd.parent is not None and not nd.children and not nd.locks[0] and not self._useful(nd):
            parent = nd.parent
            self._remove(nd, freed)
            nd = parent
        return nd

    def _useful(self, leaf: Node) -> bool:
        for c in self._rules:
            if not c.accepts_end(leaf):
                return False
        return True

    def _tombstone(self, nd: Node, ci: int, freed: Freed) -> None:
        """Slot (nd, ci) is lost in every tier; leaves that depended on it go."""
        c = self.components[ci]
        v, h = nd.value[ci], nd.host[ci]
        if v is not None:
            freed.device[ci] += v
            self.size[ci] -= len(v)
            nd.value[ci] = None
        if h is not None:
            freed.on_host[ci] += h
            self.host_size[ci] -= len(h)
            nd.host[ci] = None
        self.tombstones[ci] += 1
        if c.reach == 0:
            return
        limit = None if c.reach is None else nd.end + c.reach
        leaves = []
        stack = list(nd.children.values())
        while stack:
            x = stack.pop()
            if limit is not None and x.start >= limit:
                continue
            if x.children:
                stack.extend(x.children.values())
            elif limit is None or x.end - c.reach < nd.end:
                leaves.append(x)
        for x in leaves:
            if x.attached and not x.children and not x.locks[0] and not self._useful(x):
                parent = x.parent
                self._remove(x, freed)
                self._prune_up(parent, freed)
