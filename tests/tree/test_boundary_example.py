"""The seed's boundary example (design.md §1 rule 3, §3 Boundaries), built through the
public tree API only.

Path of four nodes of 4 tokens (page size 4, SWA window 4):

    node 1 [0, 4)    checkpoint
    node 2 [4, 8)    no checkpoint
    node 3 [8, 12)   checkpoint, SWA tombstoned
    node 4 [12, 16)  no checkpoint

Safe boundary for the first 16 tokens: FULL+SWA+MAMBA = 4, FULL+SWA = 16, FULL = 16.
A fifth node [16, 20) with a checkpoint keeps node 4 internal (a MAMBA leaf without a
checkpoint at its end is useless and goes); queries read only the first 16 tokens.
"""
from array import array

import pytest

from uniradix.tree import FullComponent, MambaComponent, RadixTree, SWAComponent

P = 4
S = list(range(10, 30))               # 20 tokens, 5 pages
FULL_H = [100, 101, 102, 103, 104]    # FULL handle of page q
SWA_H = [200, 201, 202, 203, 204]     # SWA handle of page q
CKPT = {4: 300, 12: 301, 20: 302}     # MAMBA slot at position


def make_tree(names, window=4):
    comps = [FullComponent()]
    if "swa" in names:
        comps.append(SWAComponent(window, keep_all=True))
    if "mamba" in names:
        comps.append(MambaComponent())
    return RadixTree(comps, page_size=P)


def path_nodes(tree, tokens):
    """Attached nodes along `tokens`, read by walking children (no match: it touches)."""
    out = []
    nd = tree.root()
    off = 0
    while True:
        ch = nd.children.get(array("I", tokens[off:off + P]).tobytes())
        if ch is None:
            return out
        out.append(ch)
        off = ch.end
        nd = ch


def build_by_eviction(names, window=4):
    """Insert the whole path, cut node boundaries at 4, 8, 12, 16 by inserting prefixes,
    then tombstone exactly node 3's SWA: lock the other nodes (a receipt pins SWA only
    in its window, here the node itself) and evict one SWA page."""
    tree = make_tree(names, window)
    values = {"full": array("i", FULL_H)}
    if "swa" in names:
        values["swa"] = array("i", SWA_H)
    if "mamba" in names:
        values["mamba"] = dict(CKPT)
    r = tree.insert(S, values)
    assert r.existing == 0
    assert all(len(v) == 0 for v in r.free.values())
    for cut in (4, 8, 12, 16):
        dup = array("i", range(900 + 10 * cut, 900 + 10 * cut + cut // P))
        r = tree.insert(S[:cut], {"full": dup})
        assert r.existing == cut and r.node.end == cut
        assert sorted(r.free["full"]) == list(dup)  # duplicates of cached pages come back to the caller
    nodes = path_nodes(tree, S)
    assert [(n.start, n.end) for n in nodes] == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20)]
    if "swa" in names:
        # lock every node whose SWA window stays clear of node 3's span [8, 12)
        receipts = [tree.lock(n) for n in nodes if n.end <= 8 or n.end - window + 1 >= 12]
        assert tree.evictable("swa") == 1
        ev = tree.evict(swa_pages=1)
        assert list(ev.freed["swa"]) == [SWA_H[2]]
        assert ev.tombstones == 1 and ev.removed_nodes == 0
        assert list(ev.freed["full"]) == []
        if "mamba" in names:
            assert list(ev.freed["mamba"]) == []
        for rc in receipts:
            assert tree.unlock(rc) is None  # nothing became useless
    return tree


def build_with_hole(names, window=4):
    """Same tree without eviction: the structure first (FULL and checkpoints; the lock
    keeps the leaf while it has no SWA), then SWA attaches to every node but node 3,
    whose page is absent (-1)."""
    tree = make_tree(names, window)
    v = {"full": array("i", FULL_H)}
    if "mamba" in names:
        v["mamba"] = dict(CKPT)
    first = tree.insert(S, v, lock=True)
    for cut in (4, 8, 12, 16):
        # a prefix the caller matched: its handles below prefix_len are the tree's own
        r = tree.insert(S[:cut], {"full": array("i", FULL_H[: cut // P])}, prefix_len=cut)
        assert r.node.end == cut
        assert all(len(x) == 0 for x in r.free.values()), r.free
    if "swa" in names:
        dup = array("i", range(900, 905))
        r = tree.insert(S, {"full": dup, "swa": array("i", [200, 201, -1, 203, 204])})
        assert sorted(r.free["full"]) == list(dup)
        assert list(r.free["swa"]) == []
    assert tree.unlock(first.receipt) is None
    return tree


BUILDERS = [build_by_eviction, build_with_hole]


def check_shape(tree, names):
    nodes = path_nodes(tree, S)
    assert [(n.start, n.end) for n in nodes] == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20)]
    fi = tree.index["full"]
    assert [list(n.value[fi]) for n in nodes] == [[h] for h in FULL_H]
    if "swa" in names:
        si = tree.index["swa"]
        got = [None if n.value[si] is None else list(n.value[si]) for n in nodes]
        assert got == [[200], [201], None, [203], [204]]
    if "mamba" in names:
        mi = tree.index["mamba"]
        got = [None if n.value[mi] is None else list(n.value[mi]) for n in nodes]
        assert got == [[300], None, [301], None, [302]]
    assert tree.size[fi] == 5


@pytest.mark.parametrize("build", BUILDERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "names, boundary, deepest, stopped, handles",
    [
        (("full", "swa", "mamba"), 4, {"full": 16, "swa": 16, "mamba": 12}, ["mamba"],
         {"full": [100], "swa": [200], "mamba": [300]}),
        (("full", "swa"), 16, {"full": 16, "swa": 16}, [],
         {"full": [100, 101, 102, 103], "swa": [203]}),
        (("full",), 16, {"full": 16}, [], {"full": [100, 101, 102, 103]}),
        (("full", "mamba"), 12, {"full": 16, "mamba": 12}, ["mamba"],
         {"full": [100, 101, 102], "mamba": [301]}),
    ],
    ids=["full+swa+mamba", "full+swa", "full", "full+mamba"],
)
def test_seed_example(build, names, boundary, deepest, stopped, handles):
    tree = build(names)
    check_shape(tree, names)
    res = tree.match(S[:16])
    assert res.matched == 16
    assert res.boundary == boundary
    assert res.deepest == deepest
    assert res.stopped_by == stopped
    assert {k: list(v) for k, v in res.handles.items()} == handles
    assert res.node.end == boundary
    # asking again changes nothing (match touches, but needs no split here)
    again = tree.match(S[:16])
    assert (again.boundary, again.matched, again.node) == (boundary, 16, res.node)


@pytest.mark.parametrize("build", BUILDERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "query, matched, boundary, deepest, stopped, handles",
    [
        # the whole path: SWA at 20 needs only page 4, MAMBA has a checkpoint at 20
        (S, 20, 20, {"full": 20, "swa": 20, "mamba": 20}, [],
         {"full": FULL_H, "swa": [204], "mamba": [302]}),
        # ends inside node 4: matched 12; SWA rejects 12 (its window is the tombstone)
        (S[:14], 12, 4, {"full": 12, "swa": 8, "mamba": 12}, ["swa"],
         {"full": [100], "swa": [200], "mamba": [300]}),
        (S[:12], 12, 4, {"full": 12, "swa": 8, "mamba": 12}, ["swa"],
         {"full": [100], "swa": [200], "mamba": [300]}),
        # diverges inside page 2: matched rounds down to 8
        (S[:10] + [7, 7, 7, 7, 7, 7], 8, 4, {"full": 8, "swa": 8, "mamba": 4}, ["mamba"],
         {"full": [100], "swa": [200], "mamba": [300]}),
        (S[:7], 4, 4, {"full": 4, "swa": 4, "mamba": 4}, [],
         {"full": [100], "swa": [200], "mamba": [300]}),
        (S[:3], 0, 0, {"full": 0, "swa": 0, "mamba": 0}, [],
         {"full": [], "swa": [], "mamba": []}),
        ([1, 2, 3, 4, 5, 6, 7, 8], 0, 0, {"full": 0, "swa": 0, "mamba": 0}, [],
         {"full": [], "swa": [], "mamba": []}),
    ],
    ids=["all-20", "unaligned-14", "aligned-12", "diverge-10", "short-7", "tail-only", "miss"],
)
def test_seed_example_other_queries(build, query, matched, boundary, deepest, stopped, handles):
    names = ("full", "swa", "mamba")
    tree = build(names)
    res = tree.match(query)
    assert (res.matched, res.boundary) == (matched, boundary)
    assert res.deepest == deepest
    assert res.stopped_by == stopped
    assert {k: list(v) for k, v in res.handles.items()} == handles
    assert res.node.end == boundary
    check_shape(tree, names)  # boundaries are node ends here: no split happened


@pytest.mark.parametrize("build", BUILDERS, ids=lambda f: f.__name__)
def test_seed_example_wider_window(build):
    """Window 8: the boundary at 16 needs pages 2 and 3, so the tombstone on page 2
    now limits FULL+SWA to 8 (12 needs pages 1 and 2)."""
    tree = build(("full", "swa"), window=8)
    res = tree.match(S[:16])
    assert (res.matched, res.boundary) == (16, 8)
    assert res.deepest == {"full": 16, "swa": 8}
    assert res.stopped_by == ["swa"]
    assert list(res.handles["swa"]) == [200, 201]
    assert list(res.handles["full"]) == [100, 101]
    assert res.node.end == 8
    # the whole path: pages 3 and 4 are present, so 20 is valid again
    res = tree.match(S)
    assert res.boundary == 20 and list(res.handles["swa"]) == [203, 204]


def test_seed_example_junction_checkpoint_heals_boundary():
    """Adding the missing checkpoint at 8 (a later request's junction) moves the
    FULL+SWA+MAMBA boundary of the first 16 tokens from 4 to 8: the next valid one,
    since SWA still rejects 12 and MAMBA still has none at 16."""
    tree = build_by_eviction(("full", "swa", "mamba"))
    r = tree.insert(S[:8], {"full": array("i", [800, 801]), "mamba": {8: 310}})
    assert sorted(r.free["full"]) == [800, 801] and list(r.free["mamba"]) == []
    res = tree.match(S[:16])
    assert (res.matched, res.boundary) == (16, 8)
    assert res.deepest == {"full": 16, "swa": 16, "mamba": 12}
    assert list(res.handles["mamba"]) == [310]
    assert list(res.handles["swa"]) == [201]


def test_match_splits_at_boundary_inside_a_node():
    """The reuse path ends exactly at the boundary: a node that contains it is split,
    and the values on both sides stay with their pages."""
    tree = RadixTree([FullComponent(), SWAComponent(4, keep_all=True), MambaComponent()], page_size=P)
    tree.insert(S, {"full": array("i", FULL_H), "swa": array("i", SWA_H), "mamba": {8: 300, 20: 301}})
    assert tree.num_nodes == 2  # [0,8) and [8,20)
    res = tree.match(S[:18])
    assert (res.matched, res.boundary) == (16, 8)
    assert tree.num_nodes == 2  # 8 is already a node end
    r = tree.insert(S, {"full": array("i", [1, 2, 3, 4, 5]), "mamba": {16: 302}})
    assert sorted(r.free["full"]) == [1, 2, 3, 4, 5]
    assert tree.num_nodes == 3  # the checkpoint at 16 split [8,20)
    fi, si = tree.index["full"], tree.index["swa"]
    nodes = path_nodes(tree, S)
    assert [(n.start, n.end) for n in nodes] == [(0, 8), (8, 16), (16, 20)]
    assert [list(n.value[fi]) for n in nodes] == [[100, 101], [102, 103], [104]]
    assert [list(n.value[si]) for n in nodes] == [[200, 201], [202, 203], [204]]
    # a FULL+SWA-only tree splits on match: boundary 12 lies inside [8,20)
    t2 = RadixTree([FullComponent(), SWAComponent(4, keep_all=True)], page_size=P)
    t2.insert(S, {"full": array("i", FULL_H), "swa": array("i", SWA_H)})
    res = t2.match(S[:13])
    assert (res.matched, res.boundary) == (12, 12)
    assert res.node.end == 12 and t2.num_nodes == 2
    assert list(res.handles["full"]) == [100, 101, 102] and list(res.handles["swa"]) == [202]
    lower = next(iter(res.node.children.values()))
    assert (lower.start, lower.end) == (12, 20)
    assert list(lower.value[0]) == [103, 104] and list(lower.value[1]) == [203, 204]
