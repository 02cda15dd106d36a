"""Drafts from the cache: an index over the tree's own token spans, for speculative
decoding (SuffixDecoding's idea, arXiv 2411.04975, with no second structure to keep in
sync: the tree is the store, this only says where each run of tokens is in it).

Every run of GRAM tokens that ends inside a node's span is indexed under its tenant's
root, pointing at the node and at where its continuation starts. The tree keeps the
index in step: a new node adds its runs, a split moves the upper part's runs to the new
upper node, a removed node takes its runs with it. A draft for a request's last GRAM
tokens follows the occurrence on the most used path (the node's hits, then the newest),
reading the span after it and, past the node's end, its most used child, for up to k
tokens. Only a tenant's own root is searched: drafts respect salts as reuse does.

Standard library only, integer tokens, no tensors (the tree core's rule)."""
from __future__ import annotations

from itertools import islice

from .keys import TOKEN_BYTES, decode

#: tokens a run must match
GRAM = 4
#: occurrences of a run compared for a draft, the newest first
CANDIDATES = 256


class DraftIndex:
    """Where each run of `gram` tokens occurs in a RadixTree's spans (see the module). An
    entry is [node, where its continuation starts in the node's span, its run's key],
    held by its run's dict (keyed by the entry's id) and by its node's list."""

    def __init__(self, gram: int = GRAM) -> None:
        if gram < 1:
            raise ValueError(f"a draft index needs runs of at least one token, got {gram}")
        self.gram = gram
        self.runs: dict[tuple[int, bytes], dict[int, list]] = {}
        self.by_node: dict[int, list[list]] = {}   # id(node) -> its entries

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_node.values())

    # ------------------------------------------------------------------ the tree's hooks
    def add(self, node) -> None:
        """Index the runs that end inside a new node's span (their first tokens may lie in
        its ancestors)."""
        g, tb = self.gram, TOKEN_BYTES
        before, root = _before(node, g - 1)
        buf = before + node.key
        lead = len(before) // tb
        rid = id(root)
        runs, mine = self.runs, []
        width = g * tb
        for j in range(max(0, g - 1 - lead), len(node.key) // tb):  # the run ending at span token j
            a = (lead + j + 1 - g) * tb
            key = (rid, buf[a:a + width])
            entry = [node, j + 1, key]
            d = runs.get(key)
            if d is None:
                runs[key] = {id(entry): entry}
            else:
                d[id(entry)] = entry
            mine.append(entry)
        if mine:
            self.by_node[id(node)] = mine

    def split(self, lower, upper, k: int) -> None:
        """`lower` lost its first k tokens to the new `upper`: runs whose continuation
        starts within those k (or right after them) now point at the upper node."""
        mine = self.by_node.get(id(lower))
        if not mine:
            return
        up, low = [], []
        for entry in mine:
            if entry[1] <= k:
                entry[0] = upper
                up.append(entry)
            else:
                entry[1] -= k
                low.append(entry)
        if up:
            self.by_node[id(upper)] = up
        if low:
            self.by_node[id(lower)] = low
        else:
            del self.by_node[id(lower)]

    def remove(self, node) -> None:
        """A node left the tree: its runs go too."""
        runs = self.runs
        for entry in self.by_node.pop(id(node), ()):
            key = entry[2]
            d = runs[key]
            del d[id(entry)]
            if not d:
                del runs[key]

    # ------------------------------------------------------------------ drafts
    def propose(self, root, tail: bytes, k: int) -> list[int]:
        """Up to k tokens that followed `tail` (the last GRAM tokens, as the tree's bytes)
        in this root's tree: the continuation on the most used path."""
        if k <= 0 or root is None or len(tail) != self.gram * TOKEN_BYTES:
            return []
        d = self.runs.get((id(root), tail))
        if not d:
            return []
        node, at, _ = max(islice(reversed(d.values()), CANDIDATES), key=lambda e: (e[0].hits, e[0].tick))
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


def _before(node, n: int) -> tuple[bytes, object]:
    """The last n tokens before a node's span on its path (fewer near the root), and the
    path's root."""
    parts, need, p = [], n * TOKEN_BYTES, node.parent
    while p.parent is not None:
        if need > 0:
            take = p.key[-need:] if need < len(p.key) else p.key
            parts.append(take)
            need -= len(take)
        p = p.parent
    return b"".join(reversed(parts)), p
