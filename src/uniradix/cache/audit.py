"""The audit: design.md §3 "accounting is exact", checked. Every allocated handle of every
pool, in both tiers, is owned exactly once: by the tree or by one running request
(its own pages past its prefix, its state slot, checkpoints and a verify's scratch slots, the host pages it read
from L3); what a running request reads from the tree is still there; the tree's counts
agree with its nodes; and, once everything is settled, no lock is left. Tests call it
after every step; an operator's debug endpoint may too (it walks every node)."""
from __future__ import annotations

from collections import Counter


class AuditError(AssertionError):
    """An accounting rule does not hold (a leak, a double owner, a lost read)."""


def audit(cache, states=(), *, settled: bool = False) -> None:
    """Check the rules for `cache` with `states` the RequestStates that hold cache state
    (running ones, and those waiting for an L3 read). `settled`: nothing runs, so
    nothing may be locked. Raises AuditError naming what is wrong."""
    tree = cache.tree
    held = _tree_handles(tree, host=False)
    own, reads = _request_handles(cache, states)
    for ci, (name, pool) in enumerate(zip(cache.names, cache.pools)):
        h, o = held[ci], own[ci]
        dup = [x for x, k in (h + o).items() if k > 1]
        _require(not dup, f"{name}: handles owned twice (tree and/or requests): {sorted(dup)[:10]}")
        total = sum(h.values()) + sum(o.values())
        _require(pool.size - pool.available == total,
                 f"{name}: {pool.size - pool.available} handles allocated, the tree holds {sum(h.values())} "
                 f"and running requests {sum(o.values())}: leak or double free")
        if hasattr(pool, "is_allocated"):
            for x in list(h) + list(o):
                _require(pool.is_allocated(x), f"{name}: handle {x} is owned but free in the pool")
        gone = set(reads[ci]) - set(h)
        _require(not gone, f"{name}: tree pages a running request reads were evicted: {sorted(gone)[:10]}")
        _require(tree.size[ci] == sum(h.values()), f"{name}: tree.size {tree.size[ci]} != {sum(h.values())} held")
        locked = sum(len(nd.value[ci]) for nd in tree.nodes() if nd.locks[ci] and nd.value[ci] is not None)
        _require(tree.locked[ci] == locked, f"{name}: tree.locked {tree.locked[ci]} != {locked} on locked nodes")
    if cache.host is not None:
        _audit_host(cache, states)
    if settled:
        _require(not any(s.held for s in states), "a request still holds cache state")
        _require(list(tree.locked) == [0] * tree.nc, f"locks left: {tree.locked}")
        for nd in tree.nodes():
            _require(not any(nd.locks), f"a lock was left on {nd}")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise AuditError(what)


def _tree_handles(tree, host: bool) -> list[Counter]:
    out = [Counter() for _ in range(tree.nc)]
    s = tree.structural.index
    for nd in tree.nodes():
        _require(nd.attached, f"{nd} is listed but detached")
        _require(nd.value[s] is not None or nd.host[s] is not None, f"{nd}: {tree.names[s]} in no tier")
        tier = nd.host if host else nd.value
        for ci in range(tree.nc):
            if tier[ci] is not None:
                out[ci].update(tier[ci])
    return out


def _request_handles(cache, states):
    """(handles each request owns, tree handles each one reads) per component index."""
    nc, P = len(cache.pools), cache.page_size
    own = [Counter() for _ in range(nc)]
    reads = [Counter() for _ in range(nc)]
    for st in states:
        if not st.held:
            continue
        cut = st.prefix_len // P
        for c in cache.page_comps:
            pages = st.pages.get(c.name, ())
            lo = c.window_start(st.prefix_len) // P  # what its lock pins: all of FULL, a window
            reads[c.index].update(h for h in pages[lo:cut] if h >= 0)
            own[c.index].update(h for h in pages[cut:] if h >= 0)
        if cache.ckpt is not None:
            ci = cache.ckpt.index
            if st.state_slot is not None:
                own[ci][st.state_slot] += 1
            own[ci].update(st.checkpoints.values())
            own[ci].update(st.scratch.values())
    return own, reads


def _audit_host(cache, states) -> None:
    """The host tier: every allocated host handle is held exactly once, by the tree or
    by a running request (pages it read from L3 through the host, until it is cached)."""
    tree = cache.tree
    held = _tree_handles(tree, host=True)
    staged = [Counter() for _ in range(tree.nc)]
    for st in states:
        if st.staged is not None:
            for ci, hs in st.staged.handles().items():
                staged[ci].update(hs)
    for ci, (name, hp) in enumerate(zip(cache.names, cache.host.pools)):
        _require(tree.host_size[ci] == sum(held[ci].values()),
                 f"host {name}: tree.host_size {tree.host_size[ci]} != {sum(held[ci].values())} held")
        h = held[ci] + staged[ci]
        dup = [x for x, k in h.items() if k > 1]
        _require(not dup, f"host {name}: handles held twice: {sorted(dup)[:10]}")
        _require(hp.size - hp.available == sum(h.values()),
                 f"host {name}: {hp.size - hp.available} allocated, the tree and requests hold {sum(h.values())}")
