"""Spare windows (design.md §3 Retention, `SWAComponent(W, keep_spare=True)`): an insert
keeps every SWA page it brings, those no resume point needs as spares; eviction takes
spares before any other slot and never copies them down; a resume point that later
lands on a spare makes it a plain slot again."""
from array import array

from uniradix.tree import COPY_DOWN, LOSE, FullComponent, RadixTree, SWAComponent

W = 4


def A(xs):
    return array("i", xs)


def seq(n, base=1000):
    return list(range(base, base + n))


def tree(page=1, policy="lru"):
    return RadixTree([FullComponent(), SWAComponent(W, keep_spare=True)], page_size=page, eviction_policy=policy)


def swa_nodes(t):
    out, stack = [], list(t.root().children.values())
    while stack:
        nd = stack.pop()
        out.append(nd)
        stack.extend(nd.children.values())
    return sorted((n for n in out if n.value[1] is not None), key=lambda n: n.start)


def boundary(t, tokens):
    m = t.match(tokens)
    if m.receipt is not None:
        t.unlock(m.receipt)
    return m.boundary


def test_every_page_is_kept_and_only_the_end_window_is_not_spare():
    t = tree()
    t.insert(seq(20), {"full": A(range(20)), "swa": A(range(100, 120))})
    kept = swa_nodes(t)
    assert sum(len(n.value[1]) for n in kept) == 20  # nothing went back
    spare = [(n.start, n.end) for n in kept if n.spare & 2]
    plain = [(n.start, n.end) for n in kept if not n.spare & 2]
    assert spare == [(0, 17)] and plain == [(17, 20)]  # the W - 1 tokens before the end
    # a branch anywhere in the cached sequence resumes where it leaves it
    for k in (5, 9, 13):
        assert boundary(t, seq(k) + [7, 7, 7]) == k


def test_spares_go_first_then_the_rest_by_policy():
    t = tree()
    t.insert(seq(20), {"full": A(range(20)), "swa": A(range(100, 120))})
    t.insert(seq(20, 5000), {"full": A(range(20, 40)), "swa": A(range(120, 140))})
    ev = t.evict(swa_pages=17)  # the older sequence's spares (17 pages) go first...
    assert sorted(ev.freed.device[1]) == list(range(100, 117))
    assert boundary(t, seq(20) + [1]) == 20   # ...its end window stays
    assert boundary(t, seq(9) + [1]) == 0     # a branch inside it now finds no window
    ev = t.evict(swa_pages=17)  # then the newer one's spares, though the old end is older
    assert sorted(ev.freed.device[1]) == list(range(120, 137))
    assert boundary(t, seq(20) + [1]) == 20 and boundary(t, seq(20, 5000) + [1]) == 20


def test_a_junction_on_a_spare_makes_it_plain():
    t = tree()
    t.insert(seq(20), {"full": A(range(20)), "swa": A(range(100, 120))})
    m = t.match(seq(10) + [7, 7, 7, 7])  # branches at 10: resumes there, on spares
    assert m.boundary == 10
    t.insert(seq(10) + [7, 7, 7, 7], {"full": A([*m.handles["full"], 30, 31, 32, 33]),
                                      "swa": A([-1] * 10 + [130, 131, 132, 133])},
             prefix_len=10, resume_points=10)
    plain = {(n.start, n.end) for n in swa_nodes(t) if not n.spare & 2}
    assert (7, 10) in plain  # the window before the junction
    t.evict(swa_pages=sum(len(n.value[1]) for n in swa_nodes(t) if n.spare & 2))
    assert all(not n.spare & 2 for n in swa_nodes(t))
    assert boundary(t, seq(10) + [9, 9]) == 10  # the junction's window outlived the spares


def test_a_running_insert_leaves_its_window_to_its_lock():
    """A running request's insert keeps no end window of its own (its lock pins it, and
    it moves on): once unlocked, nothing of it but spares, and the spares go first."""
    t = tree()
    r = t.insert(seq(12), {"full": A(range(12)), "swa": A(range(100, 112))}, lock=True)
    assert all(n.spare & 2 for n in swa_nodes(t))
    assert t.evict(swa_pages=12).freed.device[1] == A([100, 101, 102, 103, 104, 105, 106, 107, 108])
    t.unlock(r.receipt)


def test_a_spare_is_never_copied_down_nor_written_through():
    t = RadixTree([FullComponent(), SWAComponent(W, keep_spare=True)], page_size=1)
    t.insert(seq(10), {"full": A(range(10)), "swa": A(range(100, 110))})
    assert all(ci == 0 or not nd.spare & 2 for ci, nd in t.unbacked(swa_nodes(t)[-1]))
    fates = []
    while (ev := t.next_eviction(1)) is not None:
        fates.append((ev.node.start, ev.fate))
        t.carry_out(ev, t.freed())
    assert fates[0] == (0, LOSE) and fates[1] == (7, COPY_DOWN)


def test_spare_only_eviction_stops_at_the_last_spare():
    t = tree()
    t.insert(seq(20), {"full": A(range(20)), "swa": A(range(100, 120))})
    went = []
    while (ev := t.next_eviction(1, spare_only=True)) is not None:
        went.append((ev.node.start, ev.node.end))
        t.carry_out(ev, t.freed())
    assert went == [(0, 17)]
    assert t.next_eviction(1, spare_only=True) is None and t.next_eviction(1) is not None
