"""The host tier in the tree (design.md §3 Eviction, §4): every slot has a device and a
host residency; match counts both and lists what must be loaded; device eviction keeps
a node host-only when the host has a copy; host eviction drops a copy, or loses the slot
like a device eviction when the host held the last copy; write-back backs a slot up as
it leaves the device. Handles are plain integers here: device ones from 0, host ones
from 1000, so a mix-up shows."""
from array import array
from itertools import count

import pytest

from uniradix.tree import FullComponent, MambaComponent, RadixTree, SWAComponent

import helpers as H


def hybrid(window=4, page=1, policy="lru"):
    return RadixTree([FullComponent(), SWAComponent(window), MambaComponent()],
                     page_size=page, eviction_policy=policy)


def seq(n, base=100):
    return list(range(base, base + n))


class Handles:
    """Fresh handles per tier and component, and what the tree gave back."""

    def __init__(self):
        self.dev = count(0)
        self.host = count(1000)

    def device(self, n):
        return array("i", (next(self.dev) for _ in range(n)))

    def hosted(self, n):
        return array("i", (next(self.host) for _ in range(n)))


def insert(tree, hs, tokens, ckpts=()):
    P = tree.page_size
    n = len(tokens) // P
    values = {"full": hs.device(n), "swa": hs.device(n),
              "mamba": {p: next(hs.dev) for p in ckpts}}
    return tree.insert(tokens, values, resume_points=list(ckpts))


def back_up(tree, hs, node):
    """Write-through: give every unbacked device slot on the path a host copy."""
    for ci, nd in tree.unbacked(node):
        tree.set_host(nd, ci, hs.hosted(len(nd.value[ci])))


def audit(tree):
    """Per tier, the tree's counts equal what its nodes hold; no handle is held twice."""
    size, hsize = [0] * tree.nc, [0] * tree.nc
    seen_dev, seen_host = set(), set()
    for nd in tree.nodes():
        present = False
        for ci in range(tree.nc):
            for tier, sz, seen in ((nd.value[ci], size, seen_dev), (nd.host[ci], hsize, seen_host)):
                if tier is None:
                    continue
                sz[ci] += len(tier)
                for h in tier:
                    assert (ci, h) not in seen
                    seen.add((ci, h))
        present = nd.value[0] is not None or nd.host[0] is not None
        assert present, f"{nd!r} has FULL in no tier"
    assert size == tree.size and hsize == tree.host_size


def test_device_eviction_keeps_backed_up_nodes_host_only():
    t, hs = hybrid(), Handles()
    A = seq(12)
    r = insert(t, hs, A, ckpts=(8, 12))
    back_up(t, hs, r.node)
    nodes_before = t.num_nodes
    assert t.host_size == t.size
    ev = t.evict(full_pages=100, swa_pages=100, mamba_slots=100)
    # every device slot left; nothing was lost: the nodes stay, host-only
    assert t.size == [0, 0, 0] and t.num_nodes == nodes_before
    assert ev.removed_nodes == 0 and ev.tombstones == 0
    assert sorted(ev.freed["full"]) == sorted(range(12))
    assert not any(ev.freed.host.values())
    assert t.offloaded[0] == 12
    audit(t)
    m = t.match(A + [1])
    assert m.boundary == 12 and m.handles is None
    assert m.host_tokens == 12
    assert {ci for ci, _ in m.loads} == {0, 1, 2}
    # device data alone serves nothing now
    assert t.match(A + [1], host=False).boundary == 0


def test_load_back_gives_device_handles_and_no_further_loads():
    t, hs = hybrid(page=2), Handles()
    A = seq(16)
    r = insert(t, hs, A, ckpts=(16,))
    back_up(t, hs, r.node)
    t.evict(full_pages=100, swa_pages=100, mamba_slots=100)
    m = t.match(A + [1, 2], lock=True)
    assert m.boundary == 16
    loaded = {}
    for ci, nd in m.loads:
        assert nd.value[ci] is None and nd.host[ci] is not None
        h = hs.device(len(nd.host[ci]))
        t.set_device(nd, ci, h)
        loaded.setdefault(ci, []).extend(h)
    got = t.handles_at(m.node)
    assert list(got["full"]) == loaded[0]
    assert list(got["mamba"]) == loaded[2]
    # SWA: the window before 16 (pages 6 and 7), loaded as whole nodes
    assert list(got["swa"]) == loaded[1][-2:]
    # the loaded slots are locked with the match: neither tier can evict them
    assert t.evict(full_pages=100, swa_pages=100, mamba_slots=100).count("full") == 0
    assert t.evict_host(full_pages=100, swa_pages=100, mamba_slots=100).freed.host["full"] == array("i")
    t.unlock(m.receipt)
    m2 = t.match(A + [1, 2])
    assert m2.loads == [] and m2.boundary == 16
    assert list(m2.handles["full"]) == loaded[0]
    audit(t)


def test_match_lists_only_what_is_not_on_the_device():
    t, hs = hybrid(window=2), Handles()
    A = seq(8)
    r = insert(t, hs, A, ckpts=(8,))
    back_up(t, hs, r.node)
    B = A + seq(4, base=500)
    r2 = insert(t, hs, B, ckpts=(12,))
    back_up(t, hs, r2.node)
    # drop the device copy of A's part only (its nodes are internal now: FULL may go
    # because the host keeps a copy)
    freed = t.freed()
    for a_node in t.match(A).node.path():
        for ci in range(3):
            if a_node.value[ci] is not None:
                t._drop(a_node, ci, False, freed.device[ci])
    m = t.match(B + [1])
    assert m.boundary == 12
    # FULL of [0, 8) comes from the host; the SWA window before 12 and the checkpoint
    # at 12 are on the device: no SWA or MAMBA load
    assert {ci for ci, _ in m.loads} == {0}
    assert sum(nd.end - nd.start for _, nd in m.loads) == 8
    assert m.host_tokens == 8
    assert t.match(B + [1], host=False).boundary == 0
    audit(t)


def test_host_eviction_drops_copies_first_then_loses_host_only_slots():
    t, hs = hybrid(), Handles()
    A, B = seq(8), seq(8, base=300)
    ra = insert(t, hs, A, ckpts=(8,))
    back_up(t, hs, ra.node)
    rb = insert(t, hs, B, ckpts=(8,))
    back_up(t, hs, rb.node)
    # A is older: it goes host-only (its SWA: the window [5, 8) before 8)
    t.evict(full_pages=8, swa_pages=3, mamba_slots=1)
    assert t.match(A + [1]).loads and not t.match(B + [1]).loads
    # B's copy is dropped (B stays on the device); A is host-only: losing it removes A
    ev = t.evict_host(full_pages=16)
    assert t.match(A + [1]).boundary == 0
    assert t.match(B + [1]).boundary == 8 and t.match(B + [1]).loads == []
    assert len(ev.freed.host["full"]) == 16
    assert t.host_size[0] == 0
    # A's device data was already gone; B's stays
    assert t.size[0] == 8
    audit(t)


def test_host_eviction_keeps_locked_and_ranks_sessions_last():
    t, hs = hybrid(), Handles()
    A, B, C = seq(4), seq(4, base=300), seq(4, base=500)
    for X in (A, B, C):
        r = insert(t, hs, X, ckpts=(4,))
        back_up(t, hs, r.node)
    t.evict(full_pages=100, swa_pages=100, mamba_slots=100)  # all host-only
    t.register_session("s", t.match(A).node)  # oldest, but session-referenced
    rc = t.lock(t.match(B).node)
    t.evict_host(full_pages=4)
    # C (unreferenced, unlocked) went first although A is older; B is locked
    assert t.match(C + [1]).boundary == 0
    assert t.match(A + [1]).boundary == 4 and t.match(B + [1]).boundary == 4
    t.evict_host(full_pages=4)
    assert t.match(A + [1]).boundary == 0  # only A was left to go
    assert t.match(B + [1]).boundary == 4
    t.unlock(rc)
    audit(t)


def test_write_back_backs_up_what_leaves_the_device():
    t, hs = hybrid(), Handles()
    A = seq(8)
    insert(t, hs, A, ckpts=(8,))
    asked = []

    def backup(nd, ci):
        asked.append(ci)
        return hs.hosted(len(nd.value[ci]))

    freed = H.evict_with(t, [100, 100, 100], backup)
    assert sorted(set(asked)) == [0, 1, 2]
    assert len(freed.device[0]) == 8 and not any(freed.on_host)
    assert t.size == [0, 0, 0] and t.host_size[0] == 8
    m = t.match(A + [1])
    assert m.boundary == 8 and m.loads
    # a backup that declines loses the slot as without a host tier
    t2, hs2 = hybrid(), Handles()
    insert(t2, hs2, A, ckpts=(8,))
    H.evict_with(t2, [100, 0, 0], lambda nd, ci: None)
    assert t2.num_nodes == 0 and t2.match(A + [1]).boundary == 0


def test_insert_over_a_host_only_node_gives_it_a_device_copy():
    t, hs = hybrid(), Handles()
    A = seq(8)
    r = insert(t, hs, A, ckpts=(8,))
    back_up(t, hs, r.node)
    t.evict(full_pages=100, swa_pages=100, mamba_slots=100)
    # a request that could not load computes A again and inserts it
    r2 = insert(t, hs, A, ckpts=(8,))
    assert not r2.free["full"]  # the tree kept the new device pages
    m = t.match(A + [1])
    assert m.loads == [] and m.boundary == 8
    assert t.size[0] == 8 and t.host_size[0] == 8
    audit(t)


def test_tier_errors_are_clear():
    t, hs = hybrid(), Handles()
    r = insert(t, hs, seq(8), ckpts=(8,))
    nd = r.node
    n = len(nd.value[0])
    with pytest.raises(ValueError, match=f"takes {n} handles"):
        t.set_host(nd, 0, hs.hosted(n - 1))
    t.set_host(nd, 0, hs.hosted(n))
    with pytest.raises(ValueError, match="already holds full in the host tier"):
        t.set_host(nd, 0, hs.hosted(n))
    with pytest.raises(ValueError, match="already holds full in the device tier"):
        t.set_device(nd, 0, hs.device(n))


def test_host_copies_count_in_the_boundary_reference():
    """The brute-force reading of the rule, with presence in either tier, agrees with
    match on trees where random slots were offloaded."""
    import random
    rng = random.Random(7)
    for trial in range(40):
        t, hs = hybrid(window=rng.choice([1, 3, 5]), page=rng.choice([1, 2])), Handles()
        P = t.page_size
        paths = []
        for _ in range(4):
            base = [rng.randrange(3) for _ in range(rng.randrange(0, 3) * P)]
            toks = base + [rng.randrange(3) for _ in range(rng.randrange(1, 5) * P)]
            n = len(toks) - len(toks) % P
            r = insert(t, hs, toks, ckpts=[p for p in range(P, n + 1, P) if rng.random() < 0.5])
            if r.node.parent is not None:
                back_up(t, hs, r.node)
            paths.append(toks)
        # drop random device slots the host has a copy of
        for nd in t.nodes():
            for ci in range(3):
                if nd.value[ci] is not None and nd.host[ci] is not None and rng.random() < 0.5:
                    t._drop(nd, ci, False, t.freed().device[ci])
        audit(t)
        for toks in paths:
            exp = H.brute_force(t, toks + [9], either_tier=True)
            m = t.match(toks + [9])
            assert m.boundary == exp.boundary, (trial, m.boundary, exp.boundary)
            for ci, nd in m.loads:
                assert nd.value[ci] is None and nd.host[ci] is not None


def write_back_takes(t, hs, x):
    """A write-back eviction of every FULL page is offered x, backs it up, and x leaves
    the device (its 4 pages)."""
    asked = []

    def backup(nd, ci):
        asked.append((ci, nd))
        return hs.hosted(len(nd.value[ci]))

    freed = H.evict_with(t, [100, 0, 0], backup)
    assert (0, x) in asked
    assert x.value[0] is None and x.host[0] is not None and len(freed.device[0]) == 4
    audit(t)


def test_write_back_offers_an_internal_full_slot_a_plain_eviction_skipped():
    """An internal node whose children all went host-only may leave the device once a
    write-back backs it up. A plain eviction (or a declining write-back) that passes over
    it must not take it off the eviction list: the next write-back eviction has to offer
    it, or its device pages stay stuck although nothing pins them."""
    t, hs = hybrid(window=5), Handles()  # the window before 8 starts at 4: the branch point
    A = seq(8)
    B = A[:4] + seq(4, base=500)
    for toks in (A, B):
        r = insert(t, hs, toks, ckpts=(8,))
        for ci, nd in t.unbacked(r.node):
            if nd.start >= 4:  # back up the two leaves, not their parent [0, 4)
                t.set_host(nd, ci, hs.hosted(len(nd.value[ci])))
    (x,) = [nd for nd in t.nodes() if nd.end == 4]
    assert len(x.children) == 2
    t.evict(full_pages=100)  # the leaves go host-only; x has no device FULL below it now
    assert x.value[0] is not None and x.host[0] is None and not x.locks[0]
    write_back_takes(t, hs, x)


def test_write_back_offers_an_internal_full_slot_whose_last_device_child_went_whole():
    """Like the test above, but the parent's last child with FULL on the device leaves by
    going whole (it had no host copy) while a host-only sibling stays: the parent may now
    leave the device through a write-back, so the next write-back eviction must offer it."""
    t, hs = hybrid(window=5), Handles()  # the window before 8 starts at 4: the branch point
    A = seq(8)
    B = A[:4] + seq(4, base=500)
    ra = insert(t, hs, A, ckpts=(8,))
    for ci, nd in t.unbacked(ra.node):
        if nd.start >= 4:  # back up A's leaf only
            t.set_host(nd, ci, hs.hosted(len(nd.value[ci])))
    insert(t, hs, B, ckpts=(8,))  # B's leaf: on the device only
    (x,) = [nd for nd in t.nodes() if nd.end == 4]
    t.evict(full_pages=8)  # A's leaf goes host-only (older), then B's leaf goes whole
    assert len(x.children) == 1 and next(iter(x.children.values())).value[0] is None
    assert x.value[0] is not None and x.host[0] is None and not x.locks[0]
    write_back_takes(t, hs, x)
