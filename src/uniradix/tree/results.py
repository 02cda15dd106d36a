"""What the tree hands back: match results, insert results, lock receipts, evictions."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field


class Freed(dict):
    """Handles the tree let go of, per component name, for the caller to free: the
    device ones as the mapping, the host tier's in `.host`. Built from the tree's
    internal list (device at [index], host at [nc + index])."""

    def __init__(self, names: list[str], outs: list[array]) -> None:
        nc = len(names)
        super().__init__(zip(names, outs[:nc]))
        self.host = dict(zip(names, outs[nc:]))


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
    `free[name]`: incoming handles the tree did not keep (duplicates, out-of-window
    pages, checkpoints that attach nowhere or are already present), and `free.host`
    host copies of nodes the insert found useless: the caller frees them (`outs` holds
    the same by index, device at [i], host at [nc + i]). `receipt`: the lock on `node`
    when the insert was asked to lock."""

    __slots__ = ("node", "existing", "outs", "names", "receipt")

    def __init__(self, node, existing: int, outs: list[array], names: list[str], receipt=None):
        self.node = node
        self.existing = existing
        self.outs = outs
        self.names = names
        self.receipt = receipt

    @property
    def free(self) -> Freed:
        return Freed(self.names, self.outs)

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
