"""Unit tests of the tree's rules: split, retention, duplicates, locks, eviction order,
sessions, salts and useless leaves (design.md §3)."""
from array import array

import pytest

from uniradix.tree import (FullComponent, LockError, MambaComponent, RadixTree, SWAComponent,
                           decode)


def A(*xs):
    return array("i", xs)


def seq(n, base=1000):
    return list(range(base, base + n))


def full_only(page=1, policy="lru"):
    return RadixTree([FullComponent()], page_size=page, eviction_policy=policy)


def hybrid(window=4, page=1, keep_all=False, policy="lru"):
    return RadixTree([FullComponent(), SWAComponent(window, keep_all=keep_all), MambaComponent()],
                     page_size=page, eviction_policy=policy)


def nodes(tree, salt=None):
    out, stack = [], list(tree.root(salt).children.values())
    while stack:
        nd = stack.pop()
        out.append(nd)
        stack.extend(nd.children.values())
    return sorted(out, key=lambda n: (n.start, n.end))


# ---------------------------------------------------------------- match and insert
def test_match_splits_at_boundary_and_returns_handles():
    t = full_only()
    t.insert(seq(8), {"full": A(*range(8))})
    m = t.match(seq(5) + [7, 7])
    assert (m.boundary, m.matched) == (5, 5)
    assert m.node.end == 5 and list(m.handles["full"]) == [0, 1, 2, 3, 4]
    assert [(n.start, n.end) for n in nodes(t)] == [(0, 5), (5, 8)]
    assert list(nodes(t)[1].value[0]) == [5, 6, 7]


def test_page_alignment_drops_unaligned_tail():
    t = full_only(page=4)
    r = t.insert(seq(10), {"full": A(0, 1)})  # 10 tokens: 2 whole pages
    assert r.node.end == 8
    m = t.match(seq(7))
    assert (m.boundary, m.matched) == (4, 4)
    with pytest.raises(ValueError, match="FULL handles"):
        t.insert(seq(10), {"full": A(0, 1, 2)})


def test_insert_returns_duplicates_past_prefix_len():
    t = full_only()
    t.insert(seq(6), {"full": A(*range(6))})
    # a second request computed tokens 2..8 itself: its pages for 2..6 are duplicates
    r = t.insert(seq(8), {"full": A(0, 1, 12, 13, 14, 15, 16, 17)}, prefix_len=2)
    assert r.existing == 6
    assert list(r.free["full"]) == [12, 13, 14, 15]
    assert list(t.match(seq(8)).handles["full"]) == [0, 1, 2, 3, 4, 5, 16, 17]
    assert t.size[0] == 8


def test_split_slices_values_keeps_checkpoint_lower_copies_locks():
    t = hybrid(window=9, keep_all=True)  # the window before 8 is the whole path
    t.insert(seq(8), {"full": A(*range(8)), "swa": A(*range(10, 18)), "mamba": {8: 5}})
    rc = t.lock(t.match(seq(8)).node)
    assert t.locked[0] == 8
    t.insert(seq(3) + [1, 1], {"full": A(0, 1, 2, 20, 21), "swa": A(10, 11, 12, 30, 31),
                                "mamba": {5: 6}}, prefix_len=3)
    up, low = nodes(t)[0], nodes(t)[2]
    assert (up.start, up.end, low.start, low.end) == (0, 3, 3, 8)
    assert list(up.value[0]) == [0, 1, 2] and list(low.value[0]) == [3, 4, 5, 6, 7]
    assert list(up.value[1]) == [10, 11, 12] and list(low.value[1]) == [13, 14, 15, 16, 17]
    assert up.value[2] is None and list(low.value[2]) == [5]
    assert up.locks == [1, 1, 0] and low.locks == [1, 1, 1]
    t.unlock(rc)
    assert up.locks == [0, 0, 0] and low.locks == [0, 0, 0] and t.locked == [0, 0, 0]


def test_swa_retention_keeps_end_and_junction_windows():
    t = RadixTree([FullComponent(), SWAComponent(4)], page_size=2)
    n = 20
    r = t.insert(seq(n), {"full": A(*range(10)), "swa": A(*range(100, 110))}, resume_points=10)
    kept = {(nd.start, nd.end): (None if nd.value[1] is None else list(nd.value[1])) for nd in nodes(t)}
    assert kept == {(0, 6): None, (6, 10): [103, 104], (10, 16): None, (16, 20): [108, 109]}
    assert sorted(r.free["swa"]) == [100, 101, 102, 105, 106, 107]
    assert t.size == [10, 4]


def test_swa_retention_keeps_a_window_at_each_named_junction():
    t = RadixTree([FullComponent(), SWAComponent(4)], page_size=2)
    r = t.insert(seq(24), {"full": A(*range(12)), "swa": A(*range(100, 112))}, resume_points=(6, 14))
    kept = {(nd.start, nd.end): (None if nd.value[1] is None else list(nd.value[1])) for nd in nodes(t)}
    assert kept == {(0, 2): None, (2, 6): [101, 102], (6, 10): None, (10, 14): [105, 106],
                    (14, 20): None, (20, 24): [110, 111]}
    assert sorted(r.free["swa"]) == [100, 103, 104, 107, 108, 109]
    for b in (6, 14, 24):
        assert t.match(seq(b)).boundary == b
    assert t.match(seq(12)).boundary == 6


def test_swa_keep_all_setting_keeps_every_page():
    t = RadixTree([FullComponent(), SWAComponent(4, keep_all=True)], page_size=2)
    r = t.insert(seq(20), {"full": A(*range(10)), "swa": A(*range(100, 110))}, resume_points=10)
    assert len(r.free["swa"]) == 0 and t.size == [10, 10]


def test_insert_heals_tombstone():
    t = RadixTree([FullComponent(), SWAComponent(4)], page_size=1)
    t.insert(seq(12), {"full": A(*range(12)), "swa": A(*range(100, 112))})
    assert t.size[1] == 3  # only the end window [9, 12)
    m = t.match(seq(8))
    assert m.boundary == 0 and m.matched == 8 and m.deepest["swa"] == 0
    # a request recomputed 0..8 with SWA for the window [5, 8) before 8
    r = t.insert(seq(8), {"full": A(*range(8)), "swa": A(-1, -1, -1, -1, -1, 205, 206, 207)},
                 prefix_len=0, resume_points=8)
    assert sorted(r.free["full"]) == list(range(8))  # FULL duplicates of the cached pages
    assert len(r.free["swa"]) == 0  # healed, nothing returned
    m = t.match(seq(8))
    assert m.boundary == 8 and list(m.handles["swa"]) == [205, 206, 207]


def test_checkpoint_duplicates_returned():
    t = RadixTree([FullComponent(), MambaComponent()])
    t.insert(seq(6), {"full": A(*range(6)), "mamba": {6: 1, 3: 2}})
    r = t.insert(seq(6), {"full": A(*range(6)), "mamba": {6: 9, 3: 8}}, prefix_len=6)
    assert sorted(r.free["mamba"]) == [8, 9]
    m = t.match(seq(4))
    assert m.boundary == 3 and list(m.handles["mamba"]) == [2]


# ---------------------------------------------------------------- locks
def test_locked_data_is_never_evicted_and_double_unlock_raises():
    t = full_only()
    t.insert(seq(6), {"full": A(*range(6))})
    t.insert(seq(3, base=1), {"full": A(6, 7, 8)})
    rc = t.lock(t.match(seq(6)).node)
    ev = t.evict(full_pages=100)
    assert sorted(ev.freed["full"]) == [6, 7, 8]
    assert t.size[0] == 6 and t.evictable("full") == 0
    t.unlock(rc)
    with pytest.raises(LockError):
        t.unlock(rc)
    assert sorted(t.evict(full_pages=100).freed["full"]) == list(range(6))
    assert t.num_nodes == 0


def test_swa_lock_pins_only_the_window():
    t = RadixTree([FullComponent(), SWAComponent(4, keep_all=True)])
    t.insert(seq(12), {"full": A(*range(12)), "swa": A(*range(100, 112))})
    rc = t.lock(t.match(seq(12)).node)
    assert sorted(h for nd in rc.nodes(1) for h in nd.value[1]) == [109, 110, 111]  # [9, 12)
    ev = t.evict(swa_pages=100)
    assert sorted(ev.freed["swa"]) == list(range(100, 109))  # tombstones outside the window
    assert t.match(seq(12)).boundary == 12
    t.unlock(rc)
    assert t.locked == [0, 0]


# ---------------------------------------------------------------- eviction order
def _three_leaves(policy):
    t = full_only(policy=policy)
    for i in range(3):
        t.insert([i] + seq(3), {"full": A(10 * i, 10 * i + 1, 10 * i + 2, 10 * i + 3)})
    return t


def _first_victim(t):
    return t.evict(full_pages=1).freed["full"][0] // 10


def test_lru_evicts_least_recently_used():
    t = _three_leaves("lru")
    t.match([0] + seq(3))
    assert _first_victim(t) == 1


def test_fifo_ignores_access():
    t = _three_leaves("fifo")
    t.match([0] + seq(3))
    assert _first_victim(t) == 0


def test_lfu_evicts_least_frequently_used():
    t = _three_leaves("lfu")
    for _ in range(3):
        t.match([0] + seq(3))
        t.match([1] + seq(3))
    t.match([2] + seq(3))
    assert _first_victim(t) == 2


def test_priority_evicts_lowest_priority():
    t = full_only(policy="priority")
    for i, prio in enumerate([5, 1, 9]):
        t.insert([i] + seq(3), {"full": A(*range(10 * i, 10 * i + 4))}, priority=prio)
    assert _first_victim(t) == 1
    assert _first_victim(t) == 0


def test_parent_that_becomes_leaf_keeps_its_lru_place():
    t = full_only()
    t.insert(seq(4), {"full": A(0, 1, 2, 3)})
    t.insert(seq(2) + [7, 7], {"full": A(0, 1, 12, 13)}, prefix_len=2)  # splits at 2
    t.insert([5, 5], {"full": A(20, 21)})  # newer than everything above
    assert sorted(t.evict(full_pages=1).freed["full"]) == [2, 3]
    assert sorted(t.evict(full_pages=1).freed["full"]) == [12, 13]
    # the old parent [0, 2) is older than [5, 5] and goes before it
    assert sorted(t.evict(full_pages=1).freed["full"]) == [0, 1]


# ---------------------------------------------------------------- sessions
def test_session_references_rank_after_unreferenced():
    t = full_only()
    ends = [t.insert([i] + seq(3), {"full": A(*range(10 * i, 10 * i + 4))}).node for i in range(3)]
    t.register_session("a", ends[0])
    t.register_session("b", ends[0])
    t.register_session("c", ends[1])
    assert _first_victim(t) == 2  # unreferenced first, whatever the age
    assert _first_victim(t) == 1  # then fewer references
    assert _first_victim(t) == 0


def test_close_session_restores_base_order_and_shared_prefix_keeps_other_refs():
    t = full_only()
    a = t.insert(seq(4) + [1], {"full": A(0, 1, 2, 3, 4)}).node
    b = t.insert(seq(4) + [2], {"full": A(0, 1, 2, 3, 5)}, prefix_len=4).node
    t.register_session("a", a)
    t.register_session("b", b)
    shared = a.parent
    assert shared.refs[0] == 2
    assert t.close_session("a") and not t.close_session("a")
    assert shared.refs[0] == 1 and a.refs[0] == 0 and b.refs[0] == 1
    assert list(t.evict(full_pages=1).freed["full"]) == [4]


# ---------------------------------------------------------------- salts
def test_salts_never_share_a_prefix():
    t = full_only()
    t.insert(seq(8), {"full": A(*range(8))}, salt="tenant-a")
    assert t.match(seq(8), salt="tenant-b").matched == 0
    assert t.match(seq(8)).matched == 0
    assert t.match(seq(8), salt="tenant-a").boundary == 8


# ---------------------------------------------------------------- useless leaves
def test_leaf_without_checkpoint_is_removed_and_parent_checked():
    t = RadixTree([FullComponent(), MambaComponent()])
    t.insert(seq(4), {"full": A(0, 1, 2, 3), "mamba": {2: 7}})
    # the leaf [2, 4) has no checkpoint: useless at once, its handles come back
    assert t.num_nodes == 1 and t.size == [2, 1]
    r = t.insert(seq(6), {"full": A(0, 1, 12, 13, 14, 15)}, prefix_len=2)
    assert sorted(r.free["full"]) == [12, 13, 14, 15]
    ev = t.evict(mamba_slots=1)  # the last leaf loses its checkpoint, so goes whole
    assert list(ev.freed["mamba"]) == [7] and sorted(ev.freed["full"]) == [0, 1]
    assert t.num_nodes == 0 and t.size == [0, 0]


def test_swa_tombstone_removes_leaves_whose_window_it_breaks():
    # fifo makes the shared node the first SWA victim: it was created first
    t = RadixTree([FullComponent(), SWAComponent(4, keep_all=True)], eviction_policy="fifo")
    t.insert(seq(4), {"full": A(0, 1, 2, 3), "swa": A(10, 11, 12, 13)})
    t.insert(seq(6), {"full": A(0, 1, 2, 3, 4, 5), "swa": A(10, 11, 12, 13, 14, 15)}, prefix_len=4)
    t.insert(seq(4) + [9] * 8, {"full": A(0, 1, 2, 3, *range(20, 28)),
                                "swa": A(10, 11, 12, 13, *range(30, 38))}, prefix_len=4)
    shared = t.match(seq(4)).node
    ev = t.evict(swa_pages=1)
    assert shared.value[1] is None and ev.tombstones == 1
    # the short leaf's window [3, 6) reached into the tombstone: it went whole;
    # the long leaf's window [9, 12) did not
    assert sorted(ev.freed["full"]) == [4, 5]
    assert sorted(ev.freed["swa"]) == [10, 11, 12, 13, 14, 15]
    m = t.match(seq(4) + [9] * 8)
    assert m.boundary == 12 and list(m.handles["swa"]) == [35, 36, 37]
    assert t.match(seq(6)).boundary == 0
    assert decode(shared.key) == seq(4)


def test_tree_core_imports_only_the_standard_library():
    import subprocess
    import sys
    code = ("import sys, uniradix.tree; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
