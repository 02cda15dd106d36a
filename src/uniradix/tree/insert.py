"""Insert: a finished (or running) request's page-aligned tokens and handles go into the
tree; each component plans where nodes must split and what it keeps, then values attach
to whole nodes, and what the tree does not keep goes back to the caller."""
from __future__ import annotations

from .component import page_floor
from .keys import TOKEN_BYTES, common_prefix, encode
from .node import Node
from .results import InsertResult


class Inserting:
    """RadixTree's insert (a mixin: the state lives on the tree)."""

    def insert(self, tokens, values: dict, prefix_len: int = 0, resume_points=None,
               salt=None, priority: int | None = None, lock: bool = False) -> InsertResult:
        """Insert the page-aligned part of `tokens` with its handles.

        values: per component name. Page components: an array('i') of one handle per
        page of the aligned length, -1 where absent (FULL: none absent). Checkpoint
        components: {position: slot}. Handles of pages below `prefix_len` are the tree's
        own (the caller got them from match) and are ignored. `resume_points`: a position,
        or several, where later requests should be able to resume (where this one
        branched off the cached path, where its prompt ended): windowed components keep
        their window there. With `lock`, the end node is locked before anything could
        evict it (`result.receipt`): a running request keeps its data even where the new
        leaf is not yet useful to others.
        """
        key = tokens if isinstance(tokens, bytes) else encode(tokens)
        P = self.page_size
        n = (len(key) - len(key) % self.unit) // TOKEN_BYTES
        inc = list(map(values.get, self.names))
        full_in = inc[0]
        if full_in is None or len(full_in) != n // P:
            raise ValueError(f"insert needs {n // P} FULL handles for {n} tokens (page {P}), "
                             f"got {None if full_in is None else len(full_in)}")
        root = self.root(salt)
        path = self._walk_splitting(root, key, n)
        existing = path[-1].end if path else 0
        freed = self.freed()
        if self._single:
            return self._insert_whole_prefix(key, n, full_in, prefix_len, path, root, existing, freed,
                                             priority, lock)
        points = _resume_points(resume_points, n, P, lock)
        # boundaries the components need, then values attach to whole nodes
        plans, cuts = [], set()
        leaf = existing < n  # one new leaf, nothing to split or reconcile: _insert_leaf
        for c, v, out in zip(self.components, inc, freed.device):
            plan = c.plan(n, points, v, prefix_len, out, lock) if c.plans else ((), None, prefix_len)
            plans.append(plan)
            for p in plan[0]:
                if 0 < p < n:  # plan() gives aligned ones
                    cuts.add(p)
            if plan[2] < existing:
                leaf = False
        if leaf and cuts <= {existing}:
            if self._spares:
                self._unspare(path, plans)
            return self._insert_leaf(key, n, inc, plans, path, root, existing, freed, priority, lock)
        return self._insert_general(key, n, inc, plans, cuts, prefix_len, path, root, existing, freed,
                                    priority, lock)

    def _walk_splitting(self, root: Node, key: bytes, n: int) -> list[Node]:
        """The path the key matches, whole nodes (a node it leaves part way is split)."""
        unit, nbytes = self.unit, n * TOKEN_BYTES
        nd, path, off = root, [], 0
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
        return path

    def _insert_whole_prefix(self, key, n, full_in, prefix_len, path, root, existing, freed, priority, lock):
        """One component (FULL alone): no plans, no holes, at most one new leaf."""
        P = self.page_size
        if existing > prefix_len:
            freed.device[0] = full_in[prefix_len // P: existing // P]
        if existing < n:
            leaf = self._new_node(path[-1] if path else root, key, existing, n)
            leaf.value[0] = v = full_in[existing // P:]
            self.size[0] += len(v)
            path.append(leaf)
            self._touch_path(path, priority)
            leaf.created = leaf.tick
            self.lists[0].plain.add(leaf)  # fresh: unlocked, unreferenced
            leaf.where[0] = 1
            return InsertResult(leaf, existing, freed, self.lock(leaf) if lock else None)
        self._touch_path(path, priority)
        end = path[-1] if path else root
        return InsertResult(end, existing, freed, self.lock(end) if lock else None)

    def _insert_leaf(self, key, n, inc, plans, path, root, existing, freed, priority, lock):
        """The common shape: one new leaf below the matched path, nothing to reconcile."""
        nd = path[-1] if path else root
        leaf = self._new_node(nd, key, existing, n)
        size, value, comps, outs = self.size, leaf.value, self.components, freed.device
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
        spare = leaf.spare
        for ci, v in enumerate(leaf.value):
            if v is not None:
                if spare >> ci & 1:
                    lists[ci].place(leaf, 3)
                else:
                    lists[ci].plain.add(leaf)
                    w[ci] = 1
        if lock:
            return InsertResult(leaf, existing, freed, self.lock(leaf))
        if not self._useful(leaf):
            self._remove(leaf, freed)
            return InsertResult(self._prune_up(nd, freed), existing, freed)
        return InsertResult(leaf, existing, freed)

    def _insert_general(self, key, n, inc, plans, points, prefix_len, path, root, existing, freed,
                        priority, lock):
        """Nodes split at the components' points, new nodes between them, and existing
        nodes the insert covers reconciled (tombstones healed, duplicates freed)."""
        if existing and points:
            split = False
            for p in points:
                if p < existing:
                    split |= self._ensure_boundary(path[-1], p)
            if split:
                path = path[-1].path()
        if self._spares:
            self._unspare(path, plans)
        new = self._new_chain(key, n, points, path[-1] if path else root, existing)
        changed = self._attach_values(inc, plans, prefix_len, path, new, freed)
        touched = path + new if new else path
        self._touch_path(touched, priority)
        lists = self.lists
        for x in new:
            x.created = x.tick
            w = x.where
            for ci, v in enumerate(x.value):  # fresh: unlocked, unreferenced
                if v is not None and (ci or not x.children):
                    if x.spare >> ci & 1:
                        lists[ci].place(x, 3)
                    else:
                        lists[ci].plain.add(x)
                        w[ci] = 1
        for x in changed:
            self._place_all(x)
        end = touched[-1] if touched else root
        if lock:
            return InsertResult(end, existing, freed, self.lock(end))
        if end.parent is not None and not end.children and not end.locks[0] and not self._useful(end):
            parent = end.parent
            self._remove(end, freed)
            end = self._prune_up(parent, freed)
        return InsertResult(end, existing, freed)

    def _unspare(self, path: list[Node], plans) -> None:
        """Spare slots on the matched path that this insert's resume points need are
        spares no more (a request branched off there, or its prompt ended there): they
        rank as any other slot again."""
        for c, (_, keep, _) in zip(self.components, plans):
            if not keep or not c.keep_spare:
                continue
            ci, bit = c.index, 1 << c.index
            lo = min(k[0] for k in keep)
            for x in reversed(path):
                if x.end <= lo:
                    break
                if x.spare & bit and c._kept(keep, x.start, x.end):
                    x.spare &= ~bit
                    if x.where[ci] == 3:
                        self.lists[ci].place(x, 0)
                    self._place(ci, x)
                    if self.hosted:
                        if x.where[self.nc + ci] == 3:
                            self.host_lists[ci].place(x, 0)
                        self._place(ci, x, True)

    def _new_chain(self, key, n: int, points, parent: Node, existing: int) -> list[Node]:
        """New nodes for [existing, n), cut at the points past existing."""
        new: list[Node] = []
        if existing < n:
            s = existing
            for e in sorted(p for p in points if p > existing) + [n]:
                parent = self._new_node(parent, key, s, e)
                new.append(parent)
                s = e
        return new

    def _attach_values(self, inc, plans, prefix_len, path, new, freed) -> list[Node]:
        """Each component reconciles the existing nodes it covers and adopts the new
        ones; returns the nodes that gained a value (their eviction lists change)."""
        size, locked = self.size, self.locked
        changed = []
        for c, v, (_, keep, lo), out in zip(self.components, inc, plans, freed.device):
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
        return changed

    def _new_node(self, parent: Node, key: bytes, s: int, e: int) -> Node:
        nn = Node(key[s * TOKEN_BYTES: e * TOKEN_BYTES], s, e, parent, self.nc)
        parent.children[key[s * TOKEN_BYTES: s * TOKEN_BYTES + self.unit]] = nn
        self.num_nodes += 1
        if self.drafts is not None:
            self.drafts.add(nn)
        return nn


def _resume_points(points, n: int, P: int, running: bool = False) -> tuple:
    """The page-aligned positions in (0, n] later requests should resume at; one past
    the end stands for the end, except in a running request's insert (it is yet to come)."""
    if points is None:
        return ()
    if isinstance(points, int):
        return (page_floor(min(points, n), P),) if 0 < points and (points <= n or not running) else ()
    return tuple(sorted({page_floor(min(j, n), P) for j in points if 0 < j and (j <= n or not running)}))
