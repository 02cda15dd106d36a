"""What the tree hands back: match results, insert results, lock receipts, evictions."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field


_EMPTY = array("i")


class Freed:
    """Handles the tree let go of, for the caller to free: `device[i]` and `on_host[i]`
    per component index; by name, `freed["swa"]` (device) and `freed.host["swa"]`."""

    __slots__ = ("names", "device", "on_host")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.device = device = []
        self.on_host = on_host = []
        for _ in names:  # made per request and per eviction: slicing an empty array is the cheap new one
            device.append(_EMPTY[:])
            on_host.append(_EMPTY[:])

    def __getitem__(self, name: str) -> array:
        return self.device[self.names.index(name)]

    def keys(self):
        return list(self.names)

    def items(self):
        return list(zip(self.names, self.device))

    def values(self):
        return list(self.device)

    @property
    def host(self) -> dict[str, array]:
        return dict(zip(self.names, self.on_host))

    def __bool__(self) -> bool:
        return any(self.device) or any(self.on_host)

    def __repr__(self) -> str:
        return f"Freed(device={dict(self.items())}, host={self.host})"


@dataclass(slots=True)
class MatchResult:
    """`boundary`: deepest page-aligned position every component accepts; `node` ends
    exactly there (the root when 0). `matched`: how far the tokens matched at all (FULL,
    structural). `handles[name]`: what to reuse up to the boundary. `deepest[name]`: the
    deepest boundary that component alone would accept, to see what stopped reuse.
    `receipt`: the lock on `node` when the match was asked to lock. `loads`: (component
    index, node) of the slots the boundary counts that only the host tier holds, root
    side first; while there are any, `handles` is None (load them, then ask the tree's
    handles_at)."""

    node: object
    boundary: int
    matched: int
    handles: "dict[str, array] | None"
    deepest: dict[str, int]
    receipt: "LockReceipt | None" = None
    loads: list = field(default_factory=list)

    @property
    def host_tokens(self) -> int:
        """Tokens of FULL data below the boundary that must come from the host."""
        return sum(nd.end - nd.start for ci, nd in self.loads if ci == 0)

    @property
    def stopped_by(self) -> list[str]:
        """Components whose own limit is the boundary, when reuse stopped short of the match."""
        if self.boundary >= self.matched:
            return []
        return [n for n, d in self.deepest.items() if d < self.matched]


class InsertResult:
    """`node` ends at the inserted length; `existing` tokens were already cached;
    `free`: incoming handles the tree did not keep (duplicates, out-of-window pages,
    checkpoints that attach nowhere or are already present) and host copies of nodes the
    insert found useless, for the caller to free. `receipt`: the lock on `node` when the
    insert was asked to lock."""

    __slots__ = ("node", "existing", "free", "receipt")

    def __init__(self, node, existing: int, free: Freed, receipt=None):
        self.node = node
        self.existing = existing
        self.free = free
        self.receipt = receipt

    def __repr__(self) -> str:
        return f"InsertResult(node={self.node!r}, existing={self.existing}, free={self.free})"


@dataclass(slots=True)
class EvictResult:
    """Handles freed per component (the caller returns them to its pools); the host
    tier's in `freed.host`."""

    freed: Freed
    removed_nodes: int = 0
    tombstones: int = 0

    def count(self, name: str) -> int:
        return len(self.freed[name])


class LockReceipt:
    """Exactly what a lock pinned: per component (index, node, from) — the slots on the
    path from `node` upward whose span ends after `from` (from = -1: `node` alone). Splits
    copy counts to the new part inside the same span, so the receipt stays exact."""

    __slots__ = ("pins", "released", "node")

    def __init__(self, node=None):
        self.pins: list[tuple[int, object, int]] = []
        self.released = False
        self.node = node

    def nodes(self, ci: int) -> list:
        out = []
        for c, nd, lo in self.pins:
            if c != ci:
                continue
            if lo < 0:
                out.append(nd)
                continue
            while nd.parent is not None and nd.end > lo:
                out.append(nd)
                nd = nd.parent
        return out

    def __repr__(self) -> str:
        return f"LockReceipt(node={self.node!r}, pins={len(self.pins)}, released={self.released})"
