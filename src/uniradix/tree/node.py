"""A radix-tree node: a page-aligned token span with one slot per component."""
from __future__ import annotations


class Node:
    """One span of tokens; per component a value (handles, or None = absent/tombstone),
    a lock count and a session-reference count, all indexed by component index.

    `where[c]` records which eviction tier of component c holds the node
    (0: none, 1: unreferenced, 2: session-referenced), so membership changes are O(1).
    """

    __slots__ = ("key", "start", "end", "parent", "children", "value", "locks", "refs",
                 "where", "tick", "created", "hits", "priority", "attached")

    def __init__(self, key: bytes, start: int, end: int, parent: "Node | None", ncomp: int, tick: int = 0):
        self.key = key
        self.start = start
        self.end = end
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.value: list = [None] * ncomp
        self.locks = [0] * ncomp
        self.refs = [0] * ncomp
        self.where = [0] * ncomp
        self.tick = tick
        self.created = tick
        self.hits = 0
        self.priority = 0
        self.attached = True

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
        return f"Node[{self.start}:{self.end}] vals=({vals}) locks={self.locks}"
