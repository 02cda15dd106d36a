"""The radix tree: topology and bookkeeping over integer handles, for any set of components.

The tree decides (what matches, what is kept, what is evicted) and returns handles;
it never touches tensors. Walks call components only through `Component`'s methods,
so adding a kind of layer never edits them.
"""
from __future__ import annotations

from array import array

from .component import Component, Interval, page_floor
from .eviction import POLICIES, EvictionList
from .keys import TOKEN_BYTES, common_prefix, encode, salt_key
from .node import Node
from .results import EvictResult, Freed, InsertResult, LockReceipt, MatchResult


class LockError(RuntimeError):
    """Unlocking a receipt that was already unlocked."""


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


class RadixTree:
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
        self.sessions: dict[object, LockReceipt] = {}
        self._single = self.nc == 1      # the one-component fast paths (off once a host tier is used)
        self.hosted = False               # some slot has been given a host copy
        self._rules = self.components[1:]  # components that can make a leaf useless

    # ------------------------------------------------------------------ roots
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
        unit = self.unit
        nd = self.root(salt)
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
            b = matched
            limits = (b,)
        else:
            if host or not self.hosted:
                # FULL is on every node the tree has (in some tier): it accepts all of [0, matched]
                cur = [(0, matched)]
            else:
                cur = self.components[0].accepted(path, matched, False)
            limits = [cur[-1][1]]
            for c in self._rules:
                a = c.accepted(path, matched, host)
                limits.append(a[-1][1])
                cur = intersect(cur, a)
            b = cur[-1][1]
        # the reuse path ends exactly at b: split the node that contains it
        cut = 0
        for x in path:
            if x.end > b:
                break
            cut += 1
        touched = path
        if cut < len(path) and path[cut].start < b:
            up = self._split(path[cut], b - path[cut].start)
            touched = path[:cut] + [up] + path[cut:]
            cut += 1
            path = touched
        self._touch_path(touched, priority)
        reuse = path[:cut]
        end = reuse[-1] if reuse else self.root(salt)
        deepest = dict(zip(self.names, limits))
        if not (self.hosted and host and reuse):
            handles = {}
            for c in self.components:
                handles[c.name] = c.handles(reuse, b)
            return MatchResult(end, b, matched, handles, deepest, self.lock(end) if lock else None)
        rc = self.lock(end) if lock else None  # may split at a window start: walk the path after it
        loads = self._host_only(end)
        return MatchResult(end, b, matched, None if loads else self.handles_at(end), deepest, rc, loads)

    def _host_only(self, end: Node) -> list[tuple[int, Node]]:
        """(component index, node) of the slots reuse at end.end needs that only the host
        holds, root side first: what a load must bring to the device."""
        loads = []
        for c in self.components:
            lo = c.pin_from(end)
            if lo is None:
                continue
            ci = c.index
            nd = end
            stop = end.parent if lo < 0 else None
            while nd is not stop and nd.parent is not None and nd.end > lo:
                if nd.value[ci] is None:
                    loads.append((ci, nd))
                nd = nd.parent
        loads.reverse()
        return loads

    def handles_at(self, nd: Node) -> dict[str, array]:
        """What match would hand out for a reuse ending at nd (after a load)."""
        path = nd.path()
        return {c.name: c.handles(path, nd.end) for c in self.components}

    def _touch_path(self, path: list[Node], priority) -> None:
        """An access: LRU ticks root to leaf (deeper is newer), LFU hits, request priority."""
        clock = self.clock
        queues = self._queues
        slots = range(2 * self.nc if self.hosted else self.nc)  # host queues only once used
        for nd in path:
            clock += 1
            nd.tick = clock
            nd.hits += 1
            if priority is not None and priority > nd.priority:
                nd.priority = priority  # before the queues see the node: it is in their key
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
        up.created, up.hits, up.priority = nd.created, nd.hits, nd.priority
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

    # ------------------------------------------------------------------ insert
    def insert(self, tokens, values: dict, prefix_len: int = 0, junction=None,
               salt=None, priority: int | None = None, lock: bool = False) -> InsertResult:
        """Insert the page-aligned part of `tokens` with its handles.

        values: per component name. Page components: an array('i') of one handle per
        page of the aligned length, -1 where absent (FULL: none absent). Checkpoint
        components: {position: slot}. Handles of pages below `prefix_len` are the tree's
        own (the caller got them from match) and are ignored. `junction`: a position, or
        several, where later requests should be able to resume (where this one branched
        off, where its prompt ended): windowed components keep their window there. With
        `lock`, the end node is
        locked before anything could evict it (`result.receipt`): a running request
        keeps its data even where the new leaf is not yet useful to others.
        """
        key = tokens if isinstance(tokens, bytes) else encode(tokens)
        unit, P = self.unit, self.page_size
        nbytes = len(key) - len(key) % unit
        n = nbytes // TOKEN_BYTES
        comps = self.components
        inc = list(map(values.get, self.names))
        full_in = inc[0]
        if full_in is None or len(full_in) != n // P:
            raise ValueError(f"insert needs {n // P} FULL handles for {n} tokens (page {P}), "
                             f"got {None if full_in is None else len(full_in)}")
        if junction is None:
            junction = ()
        elif isinstance(junction, int):
            junction = (page_floor(min(junction, n), P),) if junction > 0 else ()
        else:
            junction = tuple(sorted({page_floor(min(j, n), P) for j in junction if j > 0}))
        root = self.root(salt)
        nd = root
        path: list[Node] = []
        off = 0
        while off < nbytes:
            ch = nd.children.get(key[off:off + unit])
            if ch is None:
                break
            if key.startswith(ch.key, off):
                off += len(ch.key)
            else:
                m = common_prefix(key, off, ch.key, unit)
                ch = self._split(ch, m // TOKEN_BYTES)
                off += m
            path.append(ch)
            nd = ch
        existing = off // TOKEN_BYTES
        outs = self._outs()
        names = self.names
        if self._single:
            if existing > prefix_len:
                outs[0] = full_in[prefix_len // P: existing // P]
            if existing < n:
                leaf = self._new_node(nd, key, existing, n)
                leaf.value[0] = v = full_in[existing // P:]
                self.size[0] += len(v)
                path.append(leaf)
                self._touch_path(path, priority)
                leaf.created = leaf.tick
                self.lists[0].place(leaf, 1)
                return InsertResult(leaf, existing, outs, names, self.lock(leaf) if lock else None)
            self._touch_path(path, priority)
            end = path[-1] if path else root
            return InsertResult(end, existing, outs, names, self.lock(end) if lock else None)

        # boundaries the components need, then values attach to whole nodes
        plans = [(c.plan(n, junction, v, prefix_len, out) if c.plans else ((), None, prefix_len))
                 for c, v, out in zip(comps, inc, outs)]
        points = {p for pts, _, _ in plans for p in pts if 0 < p < n}  # plan() gives aligned ones
        if existing < n and not points.difference((existing,)) and \
                all(lo >= existing for _, _, lo in plans):
            # the common shape: one new leaf below the matched path, nothing to reconcile
            leaf = self._new_node(nd, key, existing, n)
            size, value = self.size, leaf.value
            for ci in range(self.nc):
                v = inc[ci]
                if v is not None:
                    comps[ci].adopt(leaf, v, plans[ci][1], outs[ci])
                    if value[ci] is not None:
                        size[ci] += len(value[ci])
            if priority is not None:
                leaf.priority = priority
            path.append(leaf)
            self._touch_path(path, priority)
            leaf.created = leaf.tick
            lists, w = self.lists, leaf.where
            for ci, v in enumerate(leaf.value):
                if v is not None:
                    lists[ci].plain.add(leaf)
                    w[ci] = 1
            if lock:
                return InsertResult(leaf, existing, outs, names, self.lock(leaf))
            if not self._useful(leaf):
                self._remove(leaf, outs)
                return InsertResult(self._prune_up(nd, outs), existing, outs, names)
            return InsertResult(leaf, existing, outs, names)
        if existing and points:
            split = False
            for p in points:
                if p < existing:
                    split |= self._ensure_boundary(path[-1], p)
            if split:
                path = path[-1].path()
        new: list[Node] = []
        if existing < n:
            cuts = [p for p in points if p > existing]
            if cuts:
                cuts.sort()
            cuts.append(n)
            parent = path[-1] if path else root
            s = existing
            for e in cuts:
                nn = self._new_node(parent, key, s, e)
                new.append(nn)
                parent = nn
                s = e
        size, locked = self.size, self.locked
        changed = []
        for c, v, (_, keep, lo), out in zip(comps, inc, plans, outs):
            if v is None:
                continue
            ci = c.index
            for x in reversed(path):
                if x.end <= lo:
                    break
                if c.reconcile(x, v, prefix_len, keep, out):
                    k = len(x.value[ci])
                    size[ci] += k
                    if x.locks[ci]:
                        locked[ci] += k
                    changed.append(x)
            for x in new:
                c.adopt(x, v, keep, out)
                if x.value[ci] is not None:
                    size[ci] += len(x.value[ci])
        touched = path + new if new else path
        self._touch_path(touched, priority)
        lists = self.lists
        for x in new:
            x.created = x.tick
            w = x.where
            for ci, v in enumerate(x.value):  # fresh: unlocked, unreferenced
                if v is not None and (ci or not x.children):
                    lists[ci].plain.add(x)
                    w[ci] = 1
        for x in changed:
            self._place_all(x)
        end = touched[-1] if touched else root
        if lock:
            return InsertResult(end, existing, outs, names, self.lock(end))
        if end.parent is not None and not end.children and not end.locks[0] and not self._useful(end):
            parent = end.parent
            self._remove(end, outs)
            end = self._prune_up(parent, outs)
        return InsertResult(end, existing, outs, names)

    def _new_node(self, parent: Node, key: bytes, s: int, e: int) -> Node:
        nn = Node(key[s * TOKEN_BYTES: e * TOKEN_BYTES], s, e, parent, self.nc)
        parent.children[key[s * TOKEN_BYTES: s * TOKEN_BYTES + self.unit]] = nn
        self.num_nodes += 1
        return nn

    # ------------------------------------------------------------------ locks
    def lock(self, nd: Node) -> LockReceipt:
        """Pin what reuse at nd.end needs: FULL along the path, SWA its window, MAMBA the
        checkpoint. Locked slots are never evicted."""
        return self._pin_all(nd, True)

    def _pin_all(self, nd: Node, is_lock: bool) -> LockReceipt:
        """What lock (or a session reference) at nd pins, per component, counted up."""
        rc = LockReceipt(node=nd)
        if nd.parent is None:
            return rc
        for c in self.components:
            lo = c.pin_from(nd)
            if lo is None:
                continue
            if lo > 0:
                self._ensure_boundary(nd, lo)
            rc.pins.append((c.index, nd, lo))
            self._pin(c.index, nd, lo, 1, is_lock)
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
            outs = self._outs()
            parent = nd.parent
            self._remove(nd, outs)
            self._prune_up(parent, outs)
            return Freed(self.names, outs)
        return None

    def _outs(self) -> list[array]:
        """Freed handles: device ones at [component index], host ones at [nc + index]."""
        return [array("i") for _ in range(2 * self.nc)]

    def _pin(self, ci: int, nd: Node, lo: int, delta: int, is_lock: bool) -> None:
        """Walk the pinned span (see Component.pin_from) and move lock or reference counts."""
        stop = nd.parent if lo < 0 else None  # lo < 0: the node alone
        if not is_lock:
            while nd is not stop and nd.parent is not None and nd.end > lo:
                nd.refs[ci] += delta
                self._place(ci, nd)
                if self.hosted:
                    self._place(ci, nd, True)
                nd = nd.parent
            return
        while nd is not stop and nd.parent is not None and nd.end > lo:
            locks = nd.locks
            before = locks[ci]
            after = before + delta
            locks[ci] = after
            if not before or not after:
                v, h = nd.value[ci], nd.host[ci]
                if after:  # stays listed; eviction skips it
                    if v is not None:
                        self.locked[ci] += len(v)
                    if h is not None:
                        self.host_locked[ci] += len(h)
                else:  # references may have changed while locked: re-rank
                    if v is not None:
                        self.locked[ci] -= len(v)
                        if ci or not nd.children:  # the common case, inline
                            tier = 2 if nd.refs[ci] else 1
                            if tier == 2 or nd.where[ci] != tier:
                                self.lists[ci].place(nd, tier)
                        else:
                            self._place(ci, nd)
                    if h is not None:
                        self.host_locked[ci] -= len(h)
                        self._place(ci, nd, True)
            nd = nd.parent

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

    # ------------------------------------------------------------------ tiers
    def set_device(self, nd: Node, ci: int, handles: array) -> None:
        """The device now holds slot (nd, ci) too (loaded from the host): `handles` are
        the device copy, which the tree owns from now on."""
        self._attach(nd, ci, handles, False)

    def set_host(self, nd: Node, ci: int, handles: array) -> None:
        """The host now holds a copy of slot (nd, ci) (written through, backed up before
        an eviction, or prefetched): `handles` are host handles the tree owns from now on."""
        self._attach(nd, ci, handles, True)

    def _attach(self, nd: Node, ci: int, handles: array, host: bool) -> None:
        tier = nd.host if host else nd.value
        if not nd.attached:
            raise ValueError(f"{nd!r} is no longer in the tree")
        if tier[ci] is not None:
            raise ValueError(f"{nd!r} already holds {self.names[ci]} in the {'host' if host else 'device'} tier")
        c = self.components[ci]
        want = 1 if not c.slices else (nd.end - nd.start) // self.page_size
        if len(handles) != want:
            raise ValueError(f"{self.names[ci]} on {nd!r} takes {want} handles, got {len(handles)}")
        if c.slices and nd.value[ci] is None and nd.host[ci] is None:
            raise ValueError(f"{nd!r}: {self.names[ci]} is a tombstone; a tier copies data, it does not heal")
        tier[ci] = handles
        n = len(handles)
        if host:
            self.hosted = True
            self._single = False
            self.host_size[ci] += n
            if nd.locks[ci]:
                self.host_locked[ci] += n
        else:
            self.size[ci] += n
            if nd.locks[ci]:
                self.locked[ci] += n
        self._place(ci, nd)
        self._place(ci, nd, True)

    def unbacked(self, nd: Node, min_hits: int = 0) -> list[tuple[int, Node]]:
        """(component index, node) of the device slots on the path to nd that the host
        tier has no copy of, root side first; with `min_hits`, only on nodes accessed at
        least that often (selective write-through)."""
        out = []
        for x in nd.path():
            if x.hits < min_hits:
                continue
            for ci in range(self.nc):
                if x.value[ci] is not None and x.host[ci] is None:
                    out.append((ci, x))
        return out

    # ------------------------------------------------------------------ eviction
    @staticmethod
    def _evictable(ci: int, nd: Node, host: bool) -> bool:
        """Whether one tier may let go of slot (nd, ci) now. FULL shapes the tree: an
        internal node keeps it unless the other tier holds a copy, or (device tier) no
        child holds FULL on the device any more, so that a write-back can copy it to the
        host as it goes."""
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
        evictable (locked, given children, dropped, detached) are left in place and
        skipped at pop."""
        if self._evictable(ci, nd, host):
            (self.host_lists if host else self.lists)[ci].place(nd, 2 if nd.refs[ci] else 1)

    def _pop(self, ci: int, host: bool = False):
        """The next evictable slot of component ci in one tier, dropping stale entries."""
        lst = (self.host_lists if host else self.lists)[ci]
        while True:
            nd = lst.pop()
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

    def evict(self, **targets: int) -> EvictResult:
        """Free at least the given number of device handles per component, e.g.
        evict(full_pages=64, swa_pages=16, mamba_slots=1); less when only locked data is left.
        A slot the host holds a copy of only leaves the device (the node stays,
        host-only). Otherwise internal SWA/MAMBA slots become tombstones; a leaf that can
        no longer serve a valid boundary goes whole, and its parent is checked in turn."""
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

    def _evict_result(self, want: list[int], host: bool, backup=None) -> EvictResult:
        removed0, tomb0 = self.removed_nodes, sum(self.tombstones)
        outs = self.evict_counts(want, host, backup)
        return EvictResult(Freed(self.names, outs), self.removed_nodes - removed0,
                           sum(self.tombstones) - tomb0)

    def evict_counts(self, want: list[int], host: bool = False, backup=None) -> list[array]:
        """evict() (or evict_host()) by component index: the freed handles, device ones
        at [index] and host ones at [nc + index]. `backup(node, ci)` is the write-back
        hook. Device eviction: called for a slot the host has no copy of; host handles it
        returns (already holding the data) become the copy and the slot only leaves the
        device; None: the slot goes as without a host tier. Host eviction: called before
        a host-only slot is lost (to write it to the tier below); its result is unused."""
        nc = self.nc
        outs = self._outs()
        kept = []  # FULL over host-only children that no backup took: listed again after
        for ci, k in enumerate(want):
            out = outs[nc + ci] if host else outs[ci]
            while len(out) < k:
                nd = self._pop(ci, host)
                if nd is None:
                    break
                if host:
                    if nd.value[ci] is not None:  # the device keeps it: only the copy goes
                        self._drop(nd, ci, True, out)
                        continue
                    if backup is not None:
                        backup(nd, ci)
                else:
                    if nd.host[ci] is None and backup is not None:
                        v = nd.value[ci]
                        h = backup(nd, ci)  # it may evict host data to make room
                        if not nd.attached or nd.value[ci] is not v:
                            if h is not None:
                                outs[nc + ci] += h  # nd went meanwhile: the copy is not needed
                            continue
                        if h is not None:
                            self._attach(nd, ci, h, True)
                    if nd.host[ci] is not None:  # the host keeps it: the node stays
                        self.offloaded[ci] += len(nd.value[ci])
                        self._drop(nd, ci, False, out)
                        continue
                    if ci == 0 and nd.children:
                        kept.append(nd)  # over host-only children and not backed up: it stays
                        continue
                # the slot's last copy goes
                if ci == 0 or not (nd.children or any(nd.locks)):
                    parent = nd.parent
                    self._remove(nd, outs)
                    self._prune_up(parent, outs)
                else:  # internal, or a leaf whose other data is locked: only this slot goes
                    self._tombstone(nd, ci, outs)
        for nd in kept:
            self._place(0, nd)
        for ci in range(nc):
            self.evicted[ci] += len(outs[ci])
            self.host_evicted[ci] += len(outs[nc + ci])
        return outs

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

    def _remove(self, nd: Node, outs: list[array]) -> None:
        """Detach a leaf and free all its data, in both tiers."""
        value, host, size, nc = nd.value, nd.host, self.size, self.nc
        for ci in range(nc):
            v = value[ci]
            if v is not None:
                outs[ci] += v
                size[ci] -= len(v)
                value[ci] = None
            h = host[ci]
            if h is not None:
                outs[nc + ci] += h
                self.host_size[ci] -= len(h)
                host[ci] = None
        parent = nd.parent
        del parent.children[nd.key[:self.unit]]
        nd.attached = False
        self.removed_nodes += 1
        self.num_nodes -= 1
        if parent.parent is not None:
            if not parent.children:
                self._place(0, parent)
                if self.hosted:
                    self._place(0, parent, True)
            elif self.hosted:  # its last child with device FULL may have gone
                self._place(0, parent)

    def _prune_up(self, nd: Node, outs: list[array]) -> Node:
        """Remove nd and its ancestors while each is an unlocked useless leaf; returns
        the deepest node that stays."""
        while nd.parent is not None and not nd.children and not nd.locks[0] and not self._useful(nd):
            parent = nd.parent
            self._remove(nd, outs)
            nd = parent
        return nd

    def _useful(self, leaf: Node) -> bool:
        for c in self._rules:
            if not c.accepts_end(leaf):
                return False
        return True

    def _tombstone(self, nd: Node, ci: int, outs: list[array]) -> None:
        """Slot (nd, ci) is lost in every tier; leaves that depended on it go."""
        c = self.components[ci]
        v, h = nd.value[ci], nd.host[ci]
        if v is not None:
            outs[ci] += v
            self.size[ci] -= len(v)
            nd.value[ci] = None
        if h is not None:
            outs[self.nc + ci] += h
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
                self._remove(x, outs)
                self._prune_up(parent, outs)

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
