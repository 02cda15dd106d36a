"""Per-component eviction order: pluggable base policy, session references rank last.

A component's evictable slots sit in one of three tiers: spare (data no resume point
needs, kept while there is room), unreferenced (both ordered by the base policy) and
session-referenced (ordered by reference count, then the base policy). Eviction drains
them in that order: (spare, has references, number of references, base policy).

LRU and FIFO keys only grow when a node is touched, so they live in an ordered dict
(O(1) touch, O(1) pop); the few nodes that re-enter with an old key (a parent that
became a leaf, an unlocked node) wait in a small heap merged at pop time. LFU and
priority keys move both ways and use a heap with lazy deletion.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from itertools import count

from ..config import EVICTION_POLICIES

_seq = count()


class TickQueue:
    """Ordered by a key that a touch can only raise to the newest value (LRU tick, FIFO creation)."""

    __slots__ = ("od", "late", "late_key", "last", "attr", "touch_moves")

    def __init__(self, attr: str, touch_moves: bool):
        self.od: OrderedDict = OrderedDict()
        self.late: list = []
        self.late_key: dict = {}
        self.last = -1
        self.attr = attr
        self.touch_moves = touch_moves

    def add(self, nd) -> None:
        k = getattr(nd, self.attr)
        if k >= self.last:
            self.od[nd] = None
            self.last = k
        else:
            self.late_key[nd] = k
            heapq.heappush(self.late, (k, next(_seq), nd))

    def discard(self, nd) -> None:
        if self.od.pop(nd, 0) is None:
            return
        if self.late_key.pop(nd, None) is not None and len(self.late) > 2 * len(self.late_key) + 64:
            # the heap's entries of nodes no longer listed go now and then, not only at pop
            self.late = [e for e in self.late if self.late_key.get(e[2]) == e[0]]
            heapq.heapify(self.late)

    def touch(self, nd) -> None:
        if not self.touch_moves:
            return
        try:
            self.od.move_to_end(nd)
        except KeyError:  # waiting in the late heap
            self.discard(nd)
            self.add(nd)
        else:
            self.last = getattr(nd, self.attr)

    def pop(self):
        late = self.late
        if not late:  # the common case: the oldest key is first in the ordered dict
            return self.od.popitem(last=False)[0] if self.od else None
        while late and self.late_key.get(late[0][2]) != late[0][0]:
            heapq.heappop(late)
        if self.od:
            nd = next(iter(self.od))
            if not late or getattr(nd, self.attr) <= late[0][0]:
                del self.od[nd]
                return nd
        if late:
            nd = heapq.heappop(late)[2]
            del self.late_key[nd]
            return nd
        return None


class HeapQueue:
    """Ordered by an arbitrary key function; stale heap entries are skipped at pop."""

    __slots__ = ("heap", "entry", "keyfn")

    def __init__(self, keyfn):
        self.heap: list = []
        self.entry: dict = {}
        self.keyfn = keyfn

    def add(self, nd) -> None:
        s = next(_seq)
        self.entry[nd] = s
        heapq.heappush(self.heap, (self.keyfn(nd), s, nd))
        if len(self.heap) > 2 * len(self.entry) + 64:
            self.heap = [e for e in self.heap if self.entry.get(e[2]) == e[1]]
            heapq.heapify(self.heap)

    def discard(self, nd) -> None:
        self.entry.pop(nd, None)

    def touch(self, nd) -> None:
        self.add(nd)

    def pop(self):
        heap, entry = self.heap, self.entry
        while heap:
            _, s, nd = heapq.heappop(heap)
            if entry.get(nd) == s:
                del entry[nd]
                return nd
        return None


def _lfu_key(nd):
    return (nd.hits, nd.tick)


def _priority_key(nd):
    return (nd.priority, nd.tick)


POLICIES = EVICTION_POLICIES  # declared with the other settings (uniradix.config)


def base_queue(policy: str):
    if policy == "lru":
        return TickQueue("tick", touch_moves=True)
    if policy == "fifo":
        return TickQueue("created", touch_moves=False)
    if policy == "lfu":
        return HeapQueue(_lfu_key)
    if policy == "priority":
        return HeapQueue(_priority_key)
    raise ValueError(f"unknown eviction policy {policy!r}; choose one of {', '.join(POLICIES)}")


def base_key(policy: str):
    return {"lru": lambda nd: nd.tick, "fifo": lambda nd: nd.created,
            "lfu": _lfu_key, "priority": _priority_key}[policy]


class EvictionList:
    """The evictable slots of one component in one memory tier, in eviction order.
    `slot`: where in Node.where this list records membership (the component index for
    the device tier, nc + index for the host tier)."""

    __slots__ = ("ci", "slot", "plain", "ref", "spare", "spares", "_queues")

    def __init__(self, ci: int, policy: str, slot: int | None = None):
        self.ci = ci
        self.slot = ci if slot is None else slot
        self.plain = base_queue(policy)
        bk = base_key(policy)
        self.ref = HeapQueue(lambda nd, ci=ci, bk=bk: (nd.refs[ci], bk(nd)))
        self.spare = base_queue(policy)
        self.spares = False  # whether a spare was ever listed: most trees never list one
        self._queues = (None, self.plain, self.ref, self.spare)

    def place(self, nd, tier: int) -> None:
        """Put nd in tier 1 (unreferenced), 2 (session-referenced) or 3 (spare); tier 0
        takes it out."""
        cur = nd.where[self.slot]
        if cur == tier:
            if tier == 2:
                self.ref.add(nd)  # reference count changed: new key
            return
        if cur:
            self._queues[cur].discard(nd)
        if tier:
            self._queues[tier].add(nd)
            if tier == 3:
                self.spares = True
        nd.where[self.slot] = tier

    def touch(self, nd) -> None:
        tier = nd.where[self.slot]
        if tier:
            self._queues[tier].touch(nd)

    def pop(self, spare_only: bool = False):
        nd = self.spare.pop() if self.spares else None
        if nd is None:
            if spare_only:
                return None
            nd = self.plain.pop()
        if nd is None:
            nd = self.ref.pop()
            if nd is None:
                return None
        nd.where[self.slot] = 0
        return nd
