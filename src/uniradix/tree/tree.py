"""The radix tree: topology and bookkeeping over integer handles, for any set of components.

The tree decides (what matches, what is kept, what is evicted) and returns handles;
it never touches tensors. Walks call components only through `Component`'s methods,
so adding a kind of layer never edits them. Its parts live beside it: insert.py,
locks.py (locks and sessions), tiers.py (device and host residency), evict.py.
"""
from __future__ import annotations

from .component import Component, Interval
from .eviction import POLICIES, EvictionList
from .evict import Evicting
from .insert import Inserting
from .keys import TOKEN_BYTES, common_prefix, encode, salt_key
from .locks import LockError, Locking
from .node import Node
from .results import LockReceipt, MatchResult
from .tiers import Tiers

__all__ = ["RadixTree", "LockError", "intersect"]


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo = a[i][0] if a[i][0] > b[j][0] else b[j][0]
        hi = a[i][1] if a[i][1] < b[j][1] else b[j][1]
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


class RadixTree(Inserting, Locking, Tiers, Evicting):
    """One radix tree, one slot per component, one root per salt.

    components: FULL first (it is structural), then any others.
    page_size: tokens per page; keys match and values attach page by page.
    eviction_policy: base order within a component (lru, lfu, fifo, priority).
    """

    def __init__(self, components: list[Component], page_size: int = 1, eviction_policy: str = "lru"):
        if not components or not components[0].structural:
            raise ValueError("the first component must be the structural one (FULL)")
        if any(c.structural for c in components[1:]):
            raise ValueError("only one structural component")
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must be unique: {names}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if eviction_policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {eviction_policy!r}; choose one of {', '.join(POLICIES)}")
        for i, c in enumerate(components):
            if c.index >= 0:
                raise ValueError(f"component {c.name} already belongs to a tree")
            c.bind(i, page_size)
        self.components = list(components)
        self.names = names
        self.index = {n: i for i, n in enumerate(names)}
        self.evict_kws = {c.evict_kw: i for i, c in enumerate(components)}
        self.nc = len(components)
        self.page_size = page_size
        self.unit = page_size * TOKEN_BYTES
        self.policy = eviction_policy
        self.lists = [EvictionList(i, eviction_policy) for i in range(self.nc)]
        # the host tier's queues: slot nc + i of Node.where
        self.host_lists = [EvictionList(i, eviction_policy, self.nc + i) for i in range(self.nc)]
        self._queues = [lst._queues for lst in self.lists + self.host_lists]  # for touch
        self._device_slots, self._all_slots = range(self.nc), range(2 * self.nc)  # of Node.where
        self.roots: dict[str | None, Node] = {}   # by salt_key(salt)
        self.salts: dict[str | None, object] = {}  # the salt each root was made for
        self.clock = 0
        self.size = [0] * self.nc       # handles held by the tree, per component
        self.locked = [0] * self.nc     # of which pinned by a lock
        self.evicted = [0] * self.nc    # cumulative handles freed by eviction
        self.tombstones = [0] * self.nc  # cumulative internal slots evicted
        self.host_size = [0] * self.nc    # handles held in the host tier, per component
        self.host_locked = [0] * self.nc
        self.host_evicted = [0] * self.nc  # cumulative host handles freed by eviction
        self.offloaded = [0] * self.nc     # device handles dropped because the host holds a copy
        self.removed_nodes = 0
        self.num_nodes = 0
        self.sessions: dict[tuple, LockReceipt] = {}  # by keys.session_key(id, salt)
        self._single = self.nc == 1      # the one-component fast paths (off once a host tier is used)
        self._spares = any(c.keep_spare for c in self.components)  # a component keeps spares
        self.hosted = False               # some slot has been given a host copy
        self._rules = self.components[1:]  # components that can make a leaf useless
        self._kept: list[Node] = []  # FULL an eviction had to keep (see finish_eviction)
        self.structural = self.components[0]  # the component that shapes the tree (FULL)
        self.drafts = None  # a drafts.DraftIndex over the spans, kept in step (speculation's SUFFIX drafts)

    def root(self, salt=None) -> Node:
        """The root of one tenant's tree (created on first use). `roots` is keyed by
        `salt_key(salt)`, the one rule that L3's namespace follows too."""
        k = None if salt is None else salt_key(salt)
        r = self.roots.get(k)
        if r is None:
            r = self.roots[k] = Node(b"", 0, 0, None, self.nc)
            self.salts[k] = salt
        return r

    def find_root(self, salt=None) -> Node | None:
        """The root of a tenant's tree if it has one (never creates it)."""
        return self.roots.get(None if salt is None else salt_key(salt))

    def salt_of(self, root: Node):
        """The salt a root was created for."""
        return next(self.salts[k] for k, r in self.roots.items() if r is root)

    # ------------------------------------------------------------------ match
    def match(self, tokens, salt=None, priority: int | None = None, lock: bool = False,
              host: bool = True) -> MatchResult:
        """Longest reusable prefix; splits a node so that `result.node` ends at the boundary.
        With `lock`, `result.receipt` pins what the result hands out. Slots held only by
        the host tier count (`host=False`: device data alone): `result.loads` lists them,
        and `result.handles` is None until they are loaded (set_device, then handles_at)."""
        key = tokens if isinstance(tokens, bytes) else encode(tokens)
        root = self.root(salt)
        path, matched, limits, b = self._reach(key, root, host)
        # the reuse path ends exactly at b: split the node that contains it
        cut = len(path)
        if path and path[-1].end > b:
            cut = 0
            for x in path:
                if x.end > b:
                    break
                cut += 1
            if path[cut].start < b:
                path.insert(cut, self._split(path[cut], b - path[cut].start))
                cut += 1
        self._touch_path(path, priority)
        reuse = path[:cut]
        end = reuse[-1] if reuse else root
        deepest = dict(zip(self.names, limits))
        if not (self.hosted and host and reuse):
            handles = {}
            for c in self.components:
                handles[c.name] = c.handles(reuse, b)
            return MatchResult(end, b, matched, handles, deepest, self.lock(end) if lock else None)
        rc = self.lock(end) if lock else None  # may split at a window start: walk the path after it
        loads = self._host_only(end)
        return MatchResult(end, b, matched, None if loads else self.handles_at(end), deepest, rc, loads)

    def reusable(self, tokens, salt=None, host: bool = True) -> int:
        """The boundary a match of `tokens` would return now, changing nothing (no split,
        no access, no lock): what a scheduler asks before deciding to wait for more."""
        root = self.find_root(salt)
        if root is None:
            return 0
        return self._reach(tokens if isinstance(tokens, bytes) else encode(tokens), root, host)[3]

    def _reach(self, key: bytes, root: Node, host: bool):
        """(path walked, tokens matched, each component's own limit, boundary): the pure
        part of a match."""
        unit = self.unit
        nd = root
        path: list[Node] = []
        off = 0
        nbytes = len(key) - len(key) % unit
        while off < nbytes:
            ch = nd.children.get(key[off:off + unit])
            if ch is None:
                break
            path.append(ch)
            if key.startswith(ch.key, off):
                off += len(ch.key)
                nd = ch
            else:
                off += common_prefix(key, off, ch.key, unit)
                break
        matched = off // TOKEN_BYTES
        if self._single:
            return path, matched, (matched,), matched
        if host or not self.hosted:
            # FULL is on every node the tree has (in some tier): it accepts all of [0, matched],
            # so the first rule's intervals are the intersection as they are (cur None)
            cur, limits = None, [matched]
        else:
            cur = self.components[0].accepted(path, matched, False)
            limits = [cur[-1][1]]
        for c in self._rules:
            a = c.accepted(path, matched, host)
            limits.append(a[-1][1])
            cur = a if cur is None else intersect(cur, a)
        return path, matched, limits, matched if cur is None else cur[-1][1]

    def _touch_path(self, path: list[Node], priority) -> None:
        """An access: LRU ticks root to leaf (deeper is newer), LFU hits, request priority."""
        if priority is not None:
            for nd in path:  # before the queues see the nodes: it is in their key
                if priority > nd.priority:
                    nd.priority = priority
        clock = self.clock
        queues = self._queues
        slots = self._all_slots if self.hosted else self._device_slots  # host queues only once used
        for nd in path:
            clock += 1
            nd.tick = clock
            nd.hits += 1
            where = nd.where
            for ci in slots:
                tier = where[ci]
                if tier:
                    queues[ci][tier].touch(nd)
        self.clock = clock

    # ------------------------------------------------------------------ split
    def _split(self, nd: Node, k: int) -> Node:
        """Split nd after k tokens; returns the new upper part. nd keeps its identity as
        the lower part, so receipts and checkpoints that name it stay valid."""
        P, unit = self.page_size, self.unit
        kb = k * TOKEN_BYTES
        up = Node(nd.key[:kb], nd.start, nd.start + k, nd.parent, self.nc, nd.tick)
        up.created, up.hits, up.priority, up.spare = nd.created, nd.hits, nd.priority, nd.spare
        nd.parent.children[nd.key[:unit]] = up
        nd.key = nd.key[kb:]
        nd.start += k
        nd.parent = up
        up.children[nd.key[:unit]] = nd
        kp = k // P
        for c in self.components:
            ci = c.index
            if not c.slices:
                continue
            v = nd.value[ci]
            if v is not None:
                up.value[ci] = v[:kp]
                nd.value[ci] = v[kp:]
            h = nd.host[ci]
            if h is not None:
                up.host[ci] = h[:kp]
                nd.host[ci] = h[kp:]
            up.locks[ci] = nd.locks[ci]
            up.refs[ci] = nd.refs[ci]
        self.num_nodes += 1
        self._place_all(up)
        return up

    def _ensure_boundary(self, nd: Node, pos: int) -> bool:
        """Make `pos` a node boundary on the path from nd to the root; True if it split."""
        while nd.parent is not None and nd.start >= pos:
            if nd.start == pos:
                return False
            nd = nd.parent
        if nd.parent is not None and nd.start < pos < nd.end:
            self._split(nd, pos - nd.start)
            return True
        return False

    # ------------------------------------------------------------------ reporting
    def nodes(self) -> list[Node]:
        """Every node under every root (roots excluded), depth first: for audits,
        statistics and tests, not the hot path."""
        out = []
        for root in self.roots.values():
            stack = list(root.children.values())
            while stack:
                nd = stack.pop()
                out.append(nd)
                stack.extend(nd.children.values())
        return out

    def stats(self) -> dict:
        return {
            "nodes": self.num_nodes,
            "sessions": len(self.sessions),
            "removed_nodes": self.removed_nodes,
            "components": {
                c.name: {"size": self.size[i], "locked": self.locked[i],
                         "evictable": self.size[i] - self.locked[i],
                         "evicted": self.evicted[i], "tombstones": self.tombstones[i],
                         "host_size": self.host_size[i], "host_locked": self.host_locked[i],
                         "host_evicted": self.host_evicted[i], "offloaded": self.offloaded[i]}
                for i, c in enumerate(self.components)
            },
        }
