"""A radix-tree node: a page-aligned token span with one slot per component."""
from __future__ import annotations


class Node:
    """One span of tokens; per component a device value and a host value (handles, or
    None = not in that memory tier), a lock count and a session-reference count, all
    indexed by component index. A slot is present when either tier holds it; absent in
    both, it is a tombstone.

    `where[c]` (device) and `where[nc + c]` (host) record which eviction queue of
    component c holds the node (0: none, 1: unreferenced, 2: session-referenced), so
    membership changes are O(1); 3 is the spare queue, drained first.

    `spare`: a bit per component whose slot here holds data no resume point needs
    (window KV kept while there is room; see PageComponent `keep_spare`).
    """

    __slots__ = ("key", "start", "end", "parent", "children", "value", "host", "locks", "refs",
                 "where", "tick", "created", "hits", "priority", "attached", "spare")

    def __init__(self, key: bytes, start: int, end: int, parent: "Node | None", ncomp: int, tick: int = 0):
        self.key = key
        self.start = start
        self.end = end
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.value: list = [None] * ncomp
        self.host: list = [None] * ncomp
        self.locks = [0] * ncomp
        self.refs = [0] * ncomp
        self.where = [0] * (2 * ncomp)
        self.tick = tick
        self.created = tick
        self.hits = 0
        self.priority = 0
        self.attached = True
        self.spare = 0

    def path(self) -> list["Node"]:
        """Nodes from the root's first child down to this node."""
        out = []
        nd = self
        while nd.parent is not None:
            out.append(nd)
            nd = nd.parent
        out.reverse()
        return out

    def __repr__(self) -> str:
        vals = ",".join("-" if v is None else str(len(v)) for v in self.value)
        if any(h is not None for h in self.host):
            vals += " host=(" + ",".join("-" if v is None else str(len(v)) for v in self.host) + ")"
        return f"Node[{self.start}:{self.end}] vals=({vals}) locks={self.locks}"
