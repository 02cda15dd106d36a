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
        unit, P = self.unit, self.page_size
        nbytes = len(key) - len(key) % unit
        n = nbytes // TOKEN_BYTES
        comps = self.components
        inc = list(map(values.get, self.names))
        full_in = inc[0]
        if full_in is None or len(full_in) != n // P:
            raise ValueError(f"insert needs {n // P} FULL handles for {n} tokens (page {P}), "
                             f"got {None if full_in is None else len(full_in)}")
        if resume_points is None:
            resume_points = ()
        elif isinstance(resume_points, int):
            resume_points = (page_floor(min(resume_points, n), P),) if resume_points > 0 else ()
        else:
            resume_points = tuple(sorted({page_floor(min(j, n), P) for j in resume_points if j > 0}))
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
        freed = self.freed()
        outs = freed.device
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
                return InsertResult(leaf, existing, freed, self.lock(leaf) if lock else None)
            self._touch_path(path, priority)
            end = path[-1] if path else root
            return InsertResult(end, existing, freed, self.lock(end) if lock else None)

        # boundaries the components need, then values attach to whole nodes
        plans = [(c.plan(n, resume_points, v, prefix_len, out) if c.plans else ((), None, prefix_len))
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
                return InsertResult(leaf, existing, freed, self.lock(leaf))
            if not self._useful(leaf):
                self._remove(leaf, freed)
                return InsertResult(self._prune_up(nd, freed), existing, freed)
            return InsertResult(leaf, existing, freed)
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
            return InsertResult(end, existing, freed, self.lock(end))
        if end.parent is not None and not end.children and not end.locks[0] and not self._useful(end):
            parent = end.parent
            self._remove(end, freed)
            end = self._prune_up(parent, freed)
        return InsertResult(end, existing, freed)

    def _new_node(self, parent: Node, key: bytes, s: int, e: int) -> Node:
        nn = Node(key[s * TOKEN_BYTES: e * TOKEN_BYTES], s, e, parent, self.nc)
        parent.children[key[s * TOKEN_BYTES: s * TOKEN_BYTES + self.unit]] = nn
        self.num_nodes += 1
        return nn
