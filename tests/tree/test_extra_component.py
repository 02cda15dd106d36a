"""design.md §1 rule 1: a fourth component is one new class, with no edit to the walks.

`CKVComponent` below (a compressed-KV cache, say) is defined here, in the test, and
nowhere in the package: it needs KV on the whole prefix like FULL (window None), but it
is not structural, so unlike FULL it can be tombstoned on internal nodes. The tree
must insert, match, lock, unlock and evict it like any other component, with exact
accounting. The last tests hold the same receipts-and-accounting rules on the
checkpoint component of the same four-component tree.
"""
from __future__ import annotations

import ast
import inspect
from array import array

import pytest

import uniradix.tree.tree as tree_module
from uniradix.tree import FullComponent, LockError, MambaComponent, PageComponent, RadixTree, SWAComponent


import helpers as H  # tests/tree is on sys.path: pytest prepends a test file's folder


class CKVComponent(PageComponent):
    """Compressed KV: one handle per page, needed on every page of the prefix."""

    name = "ckv"

    def __init__(self) -> None:
        super().__init__(window=None)


P = 4
W = 8
A = [1] * 8 + [2] * 8          # 16 tokens
B = [1] * 8 + [3] * 8          # shares [0, 8) with A


def make(policy: str = "lru"):
    tree = RadixTree([FullComponent(), SWAComponent(W, keep_all=True), MambaComponent(), CKVComponent()],
                     page_size=P, eviction_policy=policy)
    return tree, H.Ledger(tree)


def values(led, tokens, ckpts=(), holes=None, below=0):
    """Fresh handles for every component; `holes`: {name: pages given as -1}."""
    n = len(tokens) // P
    holes = holes or {}
    v = {}
    for name in ("full", "swa", "ckv"):
        v[name] = array("i", [-1] * below) + led.page_values(name, n - below, set(holes.get(name, ())))
    v["mamba"] = {p: led.slot("mamba") for p in ckpts}
    return v


def path(tree, tokens):
    nd, out, off = tree.root(), [], 0
    while True:
        ch = nd.children.get(array("I", tokens[off:off + P]).tobytes())
        if ch is None:
            return out
        out.append(ch)
        off, nd = ch.end, ch


def settle(tree, led):
    H.check_structure(tree)
    led.check()


# --------------------------------------------------------------------------- rule 1
def test_walks_name_no_component():
    """The tree module never names a component: no import of the concrete classes, no
    string or attribute naming FULL/SWA/MAMBA outside docstrings."""
    src = inspect.getsource(tree_module)
    mod = ast.parse(src)
    docstrings = set()
    for node in ast.walk(mod):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    bad = []
    for node in ast.walk(mod):
        if isinstance(node, ast.ImportFrom) and node.module and "components" in node.module:
            bad.append(f"import from {node.module}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            low = node.value.lower()
            if any(w in low for w in ("swa", "mamba", "ckv")):
                bad.append(repr(node.value))
        if isinstance(node, (ast.Name, ast.Attribute)):
            ident = node.id if isinstance(node, ast.Name) else node.attr
            if ident in ("FullComponent", "SWAComponent", "MambaComponent", "CheckpointComponent"):
                bad.append(ident)
    assert not bad, bad


def test_ckv_registers_like_any_component():
    tree, _ = make()
    assert tree.names == ["full", "swa", "mamba", "ckv"]
    assert tree.stats()["components"]["ckv"]["size"] == 0
    ev = tree.evict(ckv_pages=1)
    assert list(ev.freed["ckv"]) == [] and ev.removed_nodes == 0
    with pytest.raises(ValueError):
        tree.evict(ckv_slots=1)


# --------------------------------------------------------------------------- insert, match
def test_insert_and_match_four_components():
    tree, led = make()
    va = values(led, A, ckpts=(8, 16))
    r = tree.insert(A, va)
    led.returned(r.free)
    assert all(len(x) == 0 for x in r.free.values())
    assert tree.size == [4, 4, 2, 4]
    res = tree.match(A)
    assert (res.matched, res.boundary) == (16, 16)
    assert res.deepest == {"full": 16, "swa": 16, "mamba": 16, "ckv": 16}
    assert list(res.handles["ckv"]) == list(va["ckv"])  # the whole prefix
    assert list(res.handles["full"]) == list(va["full"])
    assert list(res.handles["swa"]) == list(va["swa"][2:])  # the window [8, 16)
    assert list(res.handles["mamba"]) == [va["mamba"][16]]
    H.check_match(tree, A)
    H.check_match(tree, A[:13])
    settle(tree, led)


def test_ckv_gap_limits_the_boundary():
    """B brings no CKV for its own pages: every other component accepts B's end, CKV
    does not, so the boundary stops at the junction and `stopped_by` names CKV."""
    tree, led = make()
    va = values(led, A, ckpts=(8, 16))
    led.returned(tree.insert(A, va).free)
    vb = values(led, B, ckpts=(16,), holes={"ckv": [2, 3]})
    r = tree.insert(B, vb, lock=True)  # a running request keeps its leaf
    led.returned(r.free)
    # B's pages [0, 8) duplicate A's: all four components hand them back
    assert sorted(r.free["full"]) == sorted(vb["full"][:2])
    assert sorted(r.free["ckv"]) == sorted(vb["ckv"][:2])
    res = tree.match(B)
    assert (res.matched, res.boundary) == (16, 8)
    assert res.deepest == {"full": 16, "swa": 16, "mamba": 16, "ckv": 8}
    assert res.stopped_by == ["ckv"]
    assert list(res.handles["ckv"]) == list(va["ckv"][:2])
    assert list(res.handles["mamba"]) == [va["mamba"][8]]
    assert res.node.end == 8
    H.check_match(tree, B)
    settle(tree, led)
    # the receipt goes: the leaf cannot serve a boundary (CKV) and is freed whole
    freed = tree.unlock(r.receipt)
    assert freed is not None
    led.returned(freed)
    assert sorted(freed["full"]) == sorted(vb["full"][2:])
    assert sorted(freed["swa"]) == sorted(vb["swa"][2:])
    assert list(freed["mamba"]) == [vb["mamba"][16]]
    assert list(freed["ckv"]) == []
    assert tree.match(B).matched == 8
    settle(tree, led)


def test_ckv_leaf_without_data_is_not_kept():
    """Without a lock the same insert leaves nothing behind: the new leaf is useless
    for CKV and goes at once, its handles in `free`."""
    tree, led = make()
    led.returned(tree.insert(A, values(led, A, ckpts=(8, 16))).free)
    vb = values(led, B, ckpts=(16,), holes={"ckv": [3]})
    r = tree.insert(B, vb)
    led.returned(r.free)
    assert r.node.end == 8
    assert set(vb["full"]) <= set(r.free["full"])
    assert set(h for h in vb["ckv"] if h >= 0) <= set(r.free["ckv"])
    assert tree.match(B).matched == 8
    settle(tree, led)


def test_ckv_tombstone_on_internal_node_heals():
    """An internal node without CKV (kept because a request below holds a lock) limits
    every boundary below it; a later insert bringing the pages heals it."""
    tree, led = make()
    C = A[:8]
    D = A
    rc_c = tree.insert(C, values(led, C, ckpts=(8,), holes={"ckv": [0, 1]}), lock=True)
    led.returned(rc_c.free)
    rd = tree.insert(D, values(led, D, ckpts=(16,), below=2), prefix_len=8, lock=True)
    led.returned(rd.free)
    nodes = path(tree, D)
    ci = tree.index["ckv"]
    assert [(n.start, n.end) for n in nodes] == [(0, 8), (8, 16)]
    assert nodes[0].value[ci] is None and nodes[1].value[ci] is not None
    res = tree.match(D)
    assert (res.matched, res.boundary) == (16, 0)
    assert res.deepest["ckv"] == 0 and res.stopped_by == ["ckv"]
    H.check_match(tree, D)
    # heal: the same prefix again, with its CKV pages
    heal = values(led, C, ckpts=(8,))
    r = tree.insert(C, heal)
    led.returned(r.free)
    assert list(nodes[0].value[ci]) == list(heal["ckv"])
    assert sorted(r.free["full"]) == sorted(heal["full"])   # duplicates
    assert list(r.free["mamba"]) == [heal["mamba"][8]]        # already has one
    assert sorted(r.free["swa"]) == sorted(heal["swa"])       # duplicates
    assert list(r.free["ckv"]) == []                          # kept
    assert tree.size[ci] == 4
    res = tree.match(D)
    assert res.boundary == 16 and res.deepest["ckv"] == 16
    assert list(res.handles["ckv"]) == list(heal["ckv"]) + list(nodes[1].value[ci])
    H.check_match(tree, D)
    for rc in (rd.receipt, rc_c.receipt):
        assert tree.unlock(rc) is None
    settle(tree, led)


# --------------------------------------------------------------------------- locks
def test_lock_pins_ckv_on_the_whole_path():
    tree, led = make()
    led.returned(tree.insert(A, values(led, A, ckpts=(8, 16))).free)
    led.returned(tree.insert(B, values(led, B, ckpts=(16,), below=0)).free)
    assert tree.size == [6, 6, 3, 6]
    end_a = path(tree, A)[-1]
    rc = tree.lock(end_a)
    assert tree.locked[tree.index["ckv"]] == 4       # [0, 8) and [8, 16) of A
    assert tree.locked[tree.index["swa"]] == 2       # A's window [8, 16) only
    assert tree.locked[tree.index["mamba"]] == 1     # A's checkpoint only
    assert tree.evictable("ckv") == 2
    b_leaf = path(tree, B)[-1]
    b_vals = [list(v) for v in b_leaf.value]
    ev = tree.evict(ckv_pages=100)
    led.returned(ev.freed)
    # only B's own leaf went, whole; A's path is untouched
    assert not b_leaf.attached
    assert {n: sorted(v) for n, v in ev.freed.items()} == {n: sorted(v) for n, v in zip(tree.names, b_vals)}
    assert tree.match(A).boundary == 16
    assert tree.match(B).matched == 8
    assert tree.size == [4, 4, 2, 4]
    assert tree.evictable("ckv") == 0
    settle(tree, led)
    assert tree.unlock(rc) is None
    assert tree.locked == [0, 0, 0, 0]
    assert tree.evictable("ckv") == 4
    ev = tree.evict(ckv_pages=1)
    led.returned(ev.freed)
    assert len(ev.freed["ckv"]) >= 1
    settle(tree, led)
    ev = tree.evict(full_pages=100, swa_pages=100, mamba_slots=100, ckv_pages=100)
    led.returned(ev.freed)
    assert tree.size == [0, 0, 0, 0] and tree.num_nodes == 0
    settle(tree, led)
    with pytest.raises(LockError):
        tree.unlock(rc)


# --------------------------------------------------------------------------- eviction
def build_for_eviction():
    """X = [0, 8) (checkpoint at 8), two children: Y = [8, 16) locked, and a chain
    Z = [8, 16) -> L = [16, 24) (checkpoint at 24, none at 16). X and Y are pinned by
    the lock on Y; Z and L are the only evictable CKV slots, Z the least recent."""
    tree, led = make()
    X = [5] * 8
    Y = X + [6] * 8
    L = X + [7] * 16
    led.returned(tree.insert(X, values(led, X, ckpts=(8,))).free)
    led.returned(tree.insert(L, values(led, L, ckpts=(24,))).free)
    led.returned(tree.insert(L[:16], values(led, L[:16])).free)   # cuts Z | L at 16
    ry = tree.insert(Y, values(led, Y, ckpts=(16,)), lock=True)
    led.returned(ry.free)
    assert tree.match(L).boundary == 24  # touch X, Z, L in that order: Z is older than L
    z, leaf = path(tree, L)[1:]
    assert (z.start, z.end, leaf.start, leaf.end) == (8, 16, 16, 24)
    assert z.value[tree.index["mamba"]] is None
    return tree, led, X, Y, L, ry.receipt, z, leaf


def test_evict_ckv_tombstones_internal_slot_and_removes_dependent_leaves():
    tree, led, X, Y, L, rc, z, leaf = build_for_eviction()
    ci = tree.index["ckv"]
    size0 = list(tree.size)
    z_vals = [None if v is None else list(v) for v in z.value]
    leaf_vals = [None if v is None else list(v) for v in leaf.value]
    assert tree.evictable("ckv") == 4
    ev = tree.evict(ckv_pages=1)
    led.returned(ev.freed)
    # Z (internal, least recent) lost its CKV: a tombstone; L below it can no longer
    # serve any boundary (CKV needs the whole prefix), so it went whole, and Z, now a
    # useless leaf, went after it. X stays: it has another child and is locked.
    assert ev.tombstones == 1
    assert ev.removed_nodes == 2
    assert sorted(ev.freed["ckv"]) == sorted(z_vals[ci] + leaf_vals[ci])
    assert sorted(ev.freed["full"]) == sorted(z_vals[0] + leaf_vals[0])
    assert sorted(ev.freed["swa"]) == sorted(z_vals[1] + leaf_vals[1])
    assert list(ev.freed["mamba"]) == leaf_vals[2]
    assert not z.attached and not leaf.attached
    assert tree.size == [s - len(ev.freed[n]) for s, n in zip(size0, tree.names)]
    assert tree.match(L).matched == 8
    assert tree.match(Y).boundary == 16
    assert tree.tombstones[ci] == 1
    settle(tree, led)
    assert tree.unlock(rc) is None
    settle(tree, led)


def test_evict_swa_keeps_leaves_outside_its_window():
    """The same shape evicting SWA instead: Z's SWA tombstone is outside L's window
    [16, 24), so L stays and still serves its boundary (the rule reaches W - 1 tokens
    back, not the whole prefix as for CKV)."""
    tree, led, X, Y, L, rc, z, leaf = build_for_eviction()
    rc_x = tree.lock(path(tree, X)[0])  # X's own SWA window; Z and L stay evictable
    si = tree.index["swa"]
    z_swa = list(z.value[si])
    ev = tree.evict(swa_pages=1)
    led.returned(ev.freed)
    assert ev.tombstones == 1 and ev.removed_nodes == 0
    assert list(ev.freed["swa"]) == z_swa
    assert z.attached and leaf.attached and z.value[si] is None
    res = tree.match(L)
    assert res.boundary == 24
    H.check_match(tree, L)
    settle(tree, led)
    assert tree.unlock(rc) is None and tree.unlock(rc_x) is None
    settle(tree, led)


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "priority"])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 100])
def test_evict_ckv_exact_accounting(policy, k):
    """Whatever the policy picks: at least k CKV handles go (or every unlocked one),
    every remaining leaf can serve a boundary or is locked, nothing leaks, nothing is
    freed twice, and a locked path keeps its data."""
    tree, led = make(policy)
    seqs = [A, B, A[:8] + [4] * 12, B + [9] * 8, [8] * 12]
    for s in seqs:
        n = len(s) - len(s) % P
        led.returned(tree.insert(s, values(led, s, ckpts=(n, 8) if n > 8 else (n,))).free)
    keep = path(tree, B)[-1]
    rc = tree.lock(keep)
    before = tree.evictable("ckv")
    ev = tree.evict(ckv_pages=k)
    led.returned(ev.freed)
    got = len(ev.freed["ckv"])
    assert got >= min(k, before)
    assert tree.evictable("ckv") == before - got
    assert tree.match(B).boundary == len(B)
    for nd in H.all_nodes(tree):
        if not nd.children and not nd.locks[0]:
            q = H.node_tokens(nd)
            assert H.brute_force(tree, q).boundary == nd.end, nd  # useful
    settle(tree, led)
    led.returned(tree.unlock(rc))
    settle(tree, led)


# --------------------------------------------------------------------------- receipts
def test_checkpoint_lock_survives_a_split():
    """A receipt pins MAMBA on one node; splitting that node (a branch diverging inside
    it) must not spread the pin: after unlock every count is zero, and a checkpoint
    later put at the split point is evictable."""
    tree, led = make()
    led.returned(tree.insert(A, values(led, A, ckpts=(16,))).free)
    rc = tree.lock(path(tree, A)[-1])
    # the lock cut [0, 16) at 8 (the SWA window of the boundary at 16)
    assert [(n.start, n.end) for n in path(tree, A)] == [(0, 8), (8, 16)]
    locked_node = path(tree, A)[-1]
    Bx = A[:12] + [7] * 8
    led.returned(tree.insert(Bx, values(led, Bx, ckpts=(20,))).free)
    # the branch cut the locked node at 12
    assert [(n.start, n.end) for n in path(tree, A)] == [(0, 8), (8, 12), (12, 16)]
    assert path(tree, A)[-1] is locked_node
    assert tree.unlock(rc) is None
    for nd in H.all_nodes(tree):
        assert nd.locks == [0, 0, 0, 0], nd
    assert tree.locked == [0, 0, 0, 0]
    v = values(led, A[:12], ckpts=(12,))
    led.returned(tree.insert(A[:12], v).free)
    mi = tree.index["mamba"]
    assert path(tree, A)[1].value[mi] is not None
    assert tree.evictable("mamba") == tree.size[mi] == 3
    ev = tree.evict(mamba_slots=3)
    led.returned(ev.freed)
    assert v["mamba"][12] in ev.freed["mamba"]
    settle(tree, led)


def test_checkpoint_added_under_a_lock_does_not_free_the_locked_leaf():
    """A request locks its leaf before its checkpoint exists (insert(lock=True)); the
    checkpoint arrives with a later insert. Evicting MAMBA may take that checkpoint,
    but never the FULL/SWA/CKV data the receipt pins: the leaf stays."""
    tree, led = make()
    r = tree.insert(A, values(led, A), lock=True)
    led.returned(r.free)
    leaf = r.node
    held_full = list(leaf.value[0])
    v = values(led, A, ckpts=(16,))
    led.returned(tree.insert(A, v).free)
    assert leaf.value[tree.index["mamba"]] is not None
    ev = tree.evict(mamba_slots=1)
    led.returned(ev.freed)
    assert not set(held_full) & set(ev.freed["full"]), "locked FULL pages were freed"
    assert leaf.attached
    assert list(leaf.value[0]) == held_full
    assert tree.locked[0] == tree.size[0]
    settle(tree, led)
    led.returned(tree.unlock(r.receipt))
    settle(tree, led)


@pytest.mark.parametrize("pos", [10, 18, 6, 0])
def test_checkpoint_that_attaches_nowhere_comes_back(pos):
    """Every handle given to insert is kept or returned in `free` (design.md §3, accounting
    is exact; the unaligned tail's slots are freed). A checkpoint at a position that is
    no page boundary of the cached span (the end of an unaligned prompt, inside a page,
    0) cannot attach, so it must come back."""
    tree, led = make()
    toks = A + [3, 3]                 # 18 tokens: 16 cached, a 2-token tail
    v = values(led, toks, ckpts=(16,))
    extra = led.slot("mamba")
    v["mamba"][pos] = extra
    r = tree.insert(toks, v)
    led.returned(r.free)
    kept = {int(n.value[tree.index["mamba"]][0]) for n in H.all_nodes(tree)
            if n.value[tree.index["mamba"]] is not None}
    assert extra in kept or extra in r.free["mamba"], f"slot at {pos} neither kept nor returned"
    settle(tree, led)
