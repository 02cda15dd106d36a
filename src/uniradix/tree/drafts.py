"""Drafts from the cache: an index over the tree's own token spans, for speculative
decoding (SuffixDecoding's idea, arXiv 2411.04975, with no second structure to keep in
sync: the tree is the store, this only says where each run of tokens is in it).

Every run of GRAM tokens that ends inside a node's span is indexed under its tenant's
root: the run (its bytes) names the node, or the nodes, that hold it. A draft for a
request's last GRAM tokens follows the occurrence on the most used path (the node's
hits, then the newest), reading the span after it and, past the node's end, its most
used child, for up to k tokens. Only a tenant's own root is searched: drafts respect
salts as reuse does.

Indexing costs the tree what a node's tokens cost to slice and hash, in bulk (each new
node's runs go into its root's dict in one `update`; only runs already there, which a
repeated text brings, are merged one by one), because the tree is in the scheduler's
path: a prompt of 8,000 new tokens must not wait milliseconds for its index. So the
index names nodes, not positions (a draft finds the run in the node's span: one
`rfind`), and a split changes nothing in it: the runs of the new upper node keep naming
the lower one, and a draft looks for its run in the node named and in the parents split
off it. When a node leaves the tree, the nodes split off it get their own runs (they
named it) and its runs go.

Standard library only, integer tokens, no tensors (the tree core's rule)."""
from __future__ import annotations

from itertools import repeat
from operator import itemgetter
from struct import iter_unpack

from .keys import TOKEN_BYTES, decode

#: tokens a run must match
GRAM = 4
#: nodes a run that occurs in several remembers (the newest), each compared for a draft
CANDIDATES = 64

_first = itemgetter(0)


class DraftIndex:
    """Where each run of `gram` tokens occurs in a RadixTree's spans (see the module):
    per root, run bytes -> the node holding it, or a list of nodes (oldest first) where
    several do."""

    def __init__(self, gram: int = GRAM) -> None:
        if gram < 1:
            raise ValueError(f"a draft index needs runs of at least one token, got {gram}")
        self.gram = gram
        self.width = gram * TOKEN_BYTES
        self._fmt = f"{self.width}s"
        self.runs: dict[int, dict[bytes, object]] = {}   # id(root) -> run -> node | [nodes]
        self.origin: dict[int, object] = {}   # id(node) -> its parent when indexed (the nodes between were split off it)

    def __len__(self) -> int:
        """Runs held."""
        return sum(len(d) for d in self.runs.values())

    # ------------------------------------------------------------------ the tree's hooks
    def add(self, node) -> None:
        """Index the runs that end inside a new node's span (their first tokens may lie in
        its ancestors). A split needs no hook: the runs of its upper part keep naming the
        lower node (a draft looks in its parents) until that node leaves the tree."""
        self._index(node)

    def remove(self, node) -> None:
        """A node left the tree: the nodes split off it, whose runs named it, get their own;
        then its runs go."""
        top = self.origin.pop(id(node), None)
        if top is None:
            return  # never indexed
        p = node.parent
        while p is not top and p.parent is not None:
            self._index(p)
            p = p.parent
        lead, root = _before(node, self.gram - 1)
        d = self.runs.get(id(root))
        if not d:
            return
        get = d.get
        for r in self._runs_of(lead + node.key):
            v = get(r)
            if v is node:
                del d[r]
            elif type(v) is list and node in v:
                v = [x for x in v if x is not node]
                d[r] = v if len(v) > 1 else v[0]
        if not d:
            del self.runs[id(root)]

    # ------------------------------------------------------------------ drafts
    def propose(self, root, tail: bytes, k: int) -> list[int]:
        """Up to k tokens that followed `tail` (the last GRAM tokens, as the tree's bytes)
        in this root's tree: the continuation on the most used path."""
        found = self.occurrences(root, tail) if k > 0 else []
        if not found:
            return []
        node, at = max(reversed(found), key=lambda f: (f[0].hits, f[0].tick))
        out: list[int] = []
        while len(out) < k:
            n = len(node.key) // TOKEN_BYTES
            take = min(k - len(out), n - at)
            if take > 0:
                out += decode(node.key[at * TOKEN_BYTES:(at + take) * TOKEN_BYTES])
            if len(out) >= k or not node.children:
                break
            node, at = max(node.children.values(), key=lambda c: (c.hits, c.tick)), 0
        return out

    def occurrences(self, root, tail: bytes) -> list[tuple]:
        """Where `tail` occurs in this root's tree, as the index knows it: (node, the
        position in its span where the continuation starts), the last place in each node
        that holds a run where it was indexed (a node named for it, and the nodes split
        off that one), the newest last; none that has left the tree."""
        if root is None or len(tail) != self.width:
            return []
        d = self.runs.get(id(root))
        v = d.get(tail) if d else None
        if v is None:
            return []
        out = []
        for node in (v if type(v) is list else (v,)):
            if node.attached:
                out += _places(node, self.origin.get(id(node)), tail, self.gram)
        return out

    # ------------------------------------------------------------------ internals
    def _runs_of(self, buf: bytes) -> list[bytes]:
        """Every run of `gram` tokens in `buf` that starts at a token (in bulk: for each
        offset below a run's width, the runs that tile the buffer from it)."""
        w, L = self.width, len(buf)
        out: list[bytes] = []
        for o in range(0, w, TOKEN_BYTES):
            m = (L - o) // w * w
            if m > 0:
                out += map(_first, iter_unpack(self._fmt, buf[o:o + m]))
        return out

    def _index(self, node) -> None:
        """Name `node` for every run ending in its span, beside the nodes already named
        for a run (where it is one of them)."""
        lead, root = _before(node, self.gram - 1)
        keys = self._runs_of(lead + node.key)
        self.origin[id(node)] = node.parent
        if not keys:
            return
        d = self.runs.get(id(root))
        if d is None:
            d = self.runs[id(root)] = {}
        shared = [(r, d[r]) for r in d.keys() & keys] if d else ()
        d.update(zip(keys, repeat(node)))
        for r, v in shared:
            d[r] = _with(v, node)


def _with(v, node):
    """A run's names with `node` added (the newest last; removed nodes dropped)."""
    live = [x for x in (v if type(v) is list else (v,)) if x.attached and x is not node]
    if not live:
        return node
    live.append(node)
    return live[-CANDIDATES:]


def _places(node, top, tail: bytes, gram: int) -> list[tuple]:
    """(node, where the continuation starts) for the last place `tail` ends inside the
    span of `node` and of each parent below `top` (its parent when it was indexed: the
    ones between were split off it, so its runs may be theirs now), the upper first."""
    tb, w = TOKEN_BYTES, len(tail)
    out = []
    x = node
    while x is not top and x.parent is not None:
        lead = _lead(x, gram - 1)
        buf = lead + x.key
        lo = max(0, len(lead) - w + tb)  # the run must end inside x's span
        end = len(buf)
        while True:
            i = buf.rfind(tail, lo, end)
            if i < 0:
                break
            if i % tb == 0:
                out.append((x, (i + w - len(lead)) // tb))
                break
            end = i + w - 1
        x = x.parent
    out.reverse()
    return out


def _lead(node, n: int) -> bytes:
    """The last n tokens before a node's span on its path (fewer near the root)."""
    parts, need, p = [], n * TOKEN_BYTES, node.parent
    while need > 0 and p.parent is not None:
        take = p.key[-need:] if need < len(p.key) else p.key
        parts.append(take)
        need -= len(take)
        p = p.parent
    return b"".join(reversed(parts))


def _before(node, n: int) -> tuple[bytes, object]:
    """The last n tokens before a node's span on its path (fewer near the root), and the
    path's root."""
    lead = _lead(node, n)
    p = node.parent
    while p.parent is not None:
        p = p.parent
    return lead, p
