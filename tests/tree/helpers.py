"""Shared test helpers for the tree core: a brute-force reading of the boundary rule
(design.md §3) and a handle ledger for exact accounting.

Nothing here calls a component's rule methods (`accepted`, `accepts_end`, `handles`):
the reference reads only the nodes (`key`, `start`, `end`, `value[index]`) and each
component's configuration (`window`, whether it is a checkpoint component).
"""
from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass

from uniradix.tree import CheckpointComponent, PageComponent, SWAComponent, decode


# --------------------------------------------------------------------------- extra components
class WholePrefixComponent(PageComponent):
    """A fourth kind of page data that must cover the whole prefix but, unlike FULL,
    may be tombstoned on internal nodes (e.g. compressed KV)."""

    name = "wpx"

    def __init__(self) -> None:
        super().__init__(window=None)


class SecondSWAComponent(SWAComponent):
    """A second sliding-window component with its own window, to check that rules of two
    windows compose."""

    name = "swa2"


# --------------------------------------------------------------------------- window sweep
SWEEP_PAGES = (1, 2, 3, 4, 16)


def sweep_windows(P: int) -> list[int]:
    """Windows whose remainder mod P is 0, 1, 2 or P - 1 (where the page rounding of the
    window's first page differs), within one page and spanning two or three, and W = 1
    (reads no earlier token)."""
    out = {1}
    for r in {0, 1 % P, 2 % P, (P - 1) % P}:
        w = r or P
        out |= {w, w + P, w + 2 * P}
    return sorted(out)


WINDOW_CASES = [(P, W) for P in SWEEP_PAGES for W in sweep_windows(P)]


# --------------------------------------------------------------------------- tree walking
def all_nodes(tree):
    """Every attached node (roots excluded), depth first."""
    return tree.nodes()


def node_tokens(nd) -> list[int]:
    """Tokens from position 0 to nd.end, read from the node keys on the path."""
    toks: list[int] = []
    for x in nd.path():
        toks.extend(decode(x.key))
    return toks


def check_structure(tree) -> None:
    """Keys, spans, parents, children keys, value lengths and `tree.size` agree."""
    P = tree.page_size
    size = [0] * tree.nc
    count = 0
    for root in tree.roots.values():
        assert root.start == root.end == 0
        stack = [root]
        while stack:
            nd = stack.pop()
            for first, ch in nd.children.items():
                count += 1
                assert ch.parent is nd
                assert ch.attached
                assert ch.start == nd.end
                assert ch.end > ch.start and ch.start % P == 0 and ch.end % P == 0
                assert len(ch.key) == 4 * (ch.end - ch.start)
                assert ch.key[: 4 * P] == first
                for c in tree.components:
                    v = ch.value[c.index]
                    if v is None:
                        continue
                    if isinstance(c, CheckpointComponent):
                        assert len(v) == 1
                    else:
                        assert len(v) == (ch.end - ch.start) // P, (c.name, ch)
                    assert all(h >= 0 for h in v)
                    size[c.index] += len(v)
                # FULL is structural: never absent on an attached node (in some tier)
                assert ch.value[0] is not None or ch.host[0] is not None, ch
                stack.append(ch)
    assert size == list(tree.size), (size, tree.size)
    assert count == tree.num_nodes


def held(tree) -> dict[str, Counter]:
    out = {c.name: Counter() for c in tree.components}
    for nd in all_nodes(tree):
        for c in tree.components:
            v = nd.value[c.index]
            if v is not None:
                out[c.name].update(v)
    return out


# --------------------------------------------------------------------------- brute force
@dataclass
class Expected:
    matched: int
    boundary: int
    deepest: dict[str, int]
    handles: dict[str, list[int]]


def _lcp(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def brute_matched(tree, tokens, salt=None):
    """Longest page-aligned common prefix of `tokens` with any cached path, and the leaf
    (or node) whose path reaches it. Found by reading every root-to-leaf key sequence."""
    P = tree.page_size
    root = tree.find_root(salt)
    best, best_leaf = 0, None
    if root is None:
        return 0, None
    stack = [(root, [])]
    while stack:
        nd, toks = stack.pop()
        if not nd.children:
            m = _lcp(toks, tokens) // P * P
            if m > best:
                best, best_leaf = m, nd
            continue
        for ch in nd.children.values():
            stack.append((ch, toks + decode(ch.key)))
    return best, best_leaf


def per_page(tree, tokens, salt=None, either_tier: bool = False):
    """(matched, {component name: per-page handle or None for pages in [0, matched)},
    {component name: {position: slot}} for checkpoint components). With `either_tier`,
    a slot only the host holds counts (its host handles stand in)."""
    P = tree.page_size
    matched, leaf = brute_matched(tree, tokens, salt)
    pages = {c.name: [None] * (matched // P) for c in tree.components if not isinstance(c, CheckpointComponent)}
    ckpts = {c.name: {} for c in tree.components if isinstance(c, CheckpointComponent)}
    if leaf is None:
        return matched, pages, ckpts
    for nd in leaf.path():
        if nd.start >= matched:
            break
        for c in tree.components:
            v = nd.value[c.index]
            if v is None and either_tier:
                v = nd.host[c.index]
            if v is None:
                continue
            if isinstance(c, CheckpointComponent):
                if nd.end <= matched:
                    ckpts[c.name][nd.end] = v[0]
            else:
                for p in range(nd.start // P, min(nd.end, matched) // P):
                    pages[c.name][p] = v[p - nd.start // P]
    return matched, pages, ckpts


def page_rule_pages(window, b: int, P: int) -> list[int]:
    """Pages a page component needs present for boundary b: all of [0, b) without a
    window, else every page touching [max(0, b - W + 1), b): a query at i reads keys
    i - W < j <= i, so the first query resumed at b reads back to b - W + 1."""
    lo = 0 if window is None else max(0, b - window + 1)
    return [q for q in range(b // P) if q * P < b and (q + 1) * P > lo]


def brute_force(tree, tokens, salt=None, either_tier: bool = False) -> Expected:
    P = tree.page_size
    matched, pages, ckpts = per_page(tree, tokens, salt, either_tier)
    valid: dict[str, list[int]] = {}
    for c in tree.components:
        ok = []
        for b in range(0, matched + 1, P):
            if b == 0:
                ok.append(b)
            elif isinstance(c, CheckpointComponent):
                if b in ckpts[c.name]:
                    ok.append(b)
            elif all(pages[c.name][q] is not None for q in page_rule_pages(c.window, b, P)):
                ok.append(b)
        valid[c.name] = ok
    common = set(valid[tree.components[0].name])
    for c in tree.components[1:]:
        common &= set(valid[c.name])
    boundary = max(common)
    deepest = {name: max(v) for name, v in valid.items()}
    handles = {}
    for c in tree.components:
        if isinstance(c, CheckpointComponent):
            handles[c.name] = [ckpts[c.name][boundary]] if boundary in ckpts[c.name] else []
        else:
            handles[c.name] = [pages[c.name][q] for q in page_rule_pages(c.window, boundary, P)]
    return Expected(matched, boundary, deepest, handles)


def check_match(tree, tokens, salt=None, recheck: bool = False) -> Expected:
    """Match `tokens` and hold every field of the result against the brute force."""
    exp = brute_force(tree, tokens, salt)
    res = tree.match(tokens, salt=salt)
    ctx = (list(tokens), exp)
    assert res.matched == exp.matched, ctx
    assert res.boundary == exp.boundary, ctx
    if tree.nc > 1:
        assert res.deepest == exp.deepest, ctx
    else:
        assert res.deepest == {tree.names[0]: exp.boundary}, ctx
    for name, hs in exp.handles.items():
        assert list(res.handles[name]) == hs, (name, ctx)
    assert res.node.end == exp.boundary, ctx
    assert res.node.parent is None or res.node.attached, ctx
    assert node_tokens(res.node) == list(tokens[: exp.boundary]), ctx
    if exp.boundary < exp.matched:
        assert res.stopped_by == [n for n, d in exp.deepest.items() if d < exp.matched], ctx
    else:
        assert res.stopped_by == [], ctx
    if recheck:  # the split match may do changes nothing a second look sees
        again = brute_force(tree, tokens, salt)
        assert again == exp, (ctx, again)
    return exp


# --------------------------------------------------------------------------- accounting
class Ledger:
    """Every handle handed to the tree is, at any time, exactly one of: held by the tree
    (once), or handed back (once)."""

    def __init__(self, tree):
        self.tree = tree
        self.next = {c.name: 1_000_000 * (i + 1) for i, c in enumerate(tree.components)}
        self.given = {c.name: Counter() for c in tree.components}
        self.back = {c.name: Counter() for c in tree.components}

    def fresh(self, name: str, k: int) -> list[int]:
        start = self.next[name]
        self.next[name] = start + k
        return list(range(start, start + k))

    def page_values(self, name: str, npages: int, absent=frozenset()) -> array:
        """One fresh handle per page, -1 on `absent` pages."""
        hs = self.fresh(name, npages)
        out = array("i", (-1 if q in absent else h for q, h in enumerate(hs)))
        self.given[name].update(h for h in out if h >= 0)
        return out

    def slot(self, name: str) -> int:
        h = self.fresh(name, 1)[0]
        self.given[name][h] += 1
        return h

    def returned(self, freed: dict | None) -> None:
        """Record what the tree handed back (insert `free`, evict `freed`, unlock)."""
        if freed:
            for name, hs in freed.items():
                self.back[name].update(hs)

    def check(self) -> None:
        now = held(self.tree)
        for name in self.given:
            twice = [h for h, k in self.back[name].items() if k > 1]
            assert not twice, f"{name} handles returned twice: {twice}"
            never = set(self.back[name]) - set(self.given[name])
            assert not never, f"{name} handles returned but never given: {sorted(never)}"
            dup = [h for h, k in now[name].items() if k > 1]
            assert not dup, f"{name} handles held twice: {dup}"
            both = set(now[name]) & set(self.back[name])
            assert not both, f"{name} handles both held and returned: {sorted(both)}"
            missing = set(self.given[name]) - set(now[name]) - set(self.back[name])
            assert not missing, f"{name} handles leaked (neither held nor returned): {sorted(missing)}"
            foreign = set(now[name]) - set(self.given[name])
            assert not foreign, f"{name} handles held but never given: {sorted(foreign)}"


def check_locks(tree, live) -> None:
    """Lock counts are exactly what the live receipts pin (design.md §3, locks are
    receipts): for a receipt on node X, FULL (and any window-less page component) on
    every node of X's path, a windowed component on the path nodes ending after the
    start of X's window, a checkpoint component on X alone when X had a checkpoint at
    lock time. `live`: (receipt, {checkpoint component name: had a checkpoint}).
    `tree.locked` counts the handles on locked slots."""
    P = tree.page_size
    want: dict[tuple[int, int], int] = {}
    for rc, had in live:
        x = rc.node
        if x.parent is None:
            continue
        assert x.attached, f"a locked node was removed: {x}"
        for c in tree.components:
            if isinstance(c, CheckpointComponent):
                pinned = [x] if had[c.name] else []
            else:
                pages = page_rule_pages(c.window, x.end, P)
                lo = pages[0] * P if pages else x.end
                pinned = [nd for nd in x.path() if nd.end > lo]
            for nd in pinned:
                k = (id(nd), c.index)
                want[k] = want.get(k, 0) + 1
    locked = [0] * tree.nc
    for nd in all_nodes(tree):
        for c in tree.components:
            got = nd.locks[c.index]
            exp = want.get((id(nd), c.index), 0)
            assert got == exp, f"{c.name} lock count {got} on {nd}, live receipts pin it {exp} times"
            v = nd.value[c.index]
            if got and v is not None:
                locked[c.index] += len(v)
    assert locked == list(tree.locked), \
        f"tree.locked says {list(tree.locked)} handles are pinned, the locked slots hold {locked}"


def check_useful_leaves(tree) -> None:
    """design.md §3, useless leaves go: every leaf that no lock holds can serve a valid
    boundary at its own end (each component accepts it, by the brute-force rule under
    the leaf's own salt, with data in either memory tier: a host-only slot can be loaded)."""
    salt_of = {id(r): tree.salt_of(r) for r in tree.roots.values()}
    for nd in all_nodes(tree):
        if nd.children or nd.locks[0]:
            continue
        toks = node_tokens(nd)
        root = nd
        while root.parent is not None:
            root = root.parent
        exp = brute_force(tree, toks, salt_of[id(root)], either_tier=True)
        assert exp.matched == nd.end
        assert exp.boundary == nd.end, f"useless unlocked leaf {nd}: deepest {exp.deepest}"


# --------------------------------------------------------------------------- a tier, for tree tests
def evict_with(tree, want, copy=None, host: bool = False):
    """Carry out the tree's eviction plans as a tier would: `copy(node, ci)` is offered
    each device slot whose plan is COPY_DOWN (host handles holding its data, or None to
    let it go without a copy), and, on the host tier, each slot about to be lost (a write
    to the tier below; its result is unused). Returns the Freed."""
    from uniradix.tree import COPY_DOWN, LOSE
    freed = tree.freed()
    for ci, k in enumerate(want):
        out = freed.on_host[ci] if host else freed.device[ci]
        while len(out) < k:
            ev = tree.next_eviction(ci, host)
            if ev is None:
                break
            h = None
            if copy is not None:
                if not host and ev.fate == COPY_DOWN:
                    h = copy(ev.node, ci)
                elif host and ev.fate == LOSE:
                    copy(ev.node, ci)
            tree.carry_out(ev, freed, h)
    return tree.finish_eviction(freed)
