"""The eviction lists hold only what is in the tree: a node removed (its leaf evicted
whole) leaves every list at once, so a list that is seldom popped (a component whose
pool is rarely short) does not keep removed nodes, and the memory of a long-running
tree does not grow with the requests it has served."""
from array import array

import pytest

from uniradix.tree import FullComponent, MambaComponent, RadixTree, SWAComponent


def _listed(tree) -> list:
    """Every node an eviction list refers to (device and host tiers, both ranks)."""
    out = []
    for lst in (*tree.lists, *tree.host_lists):
        for q in (lst.plain, lst.ref):
            out += list(getattr(q, "od", ()))
            out += [e[2] for e in getattr(q, "late", ())]
            out += [e[2] for e in getattr(q, "heap", ())]
    return out


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "priority"])
def test_a_removed_node_leaves_every_eviction_list(policy):
    t = RadixTree([FullComponent(), SWAComponent(4), MambaComponent()], page_size=1, eviction_policy=policy)
    h = 0
    for i in range(3000):  # a new conversation each time; FULL pressure evicts the oldest whole
        n = 8
        t.insert([100_000 + i] + list(range(n - 1)), {"full": array("i", range(h, h + n)),
                                                       "swa": array("i", range(h, h + n)), "mamba": {n: i}},
                 priority=i % 5)
        h += n
        if t.size[0] > 64:
            t.evict(full_pages=8)
    listed = _listed(t)
    attached = sum(1 for _ in t.nodes())
    gone = sum(not nd.attached for nd in listed)  # a heap's lazily dropped entries, a bounded few
    assert t.removed_nodes > 2000 and gone <= 2 * attached + 130, (gone, attached, t.removed_nodes)
    assert len(listed) <= 8 * attached + 260, (len(listed), attached)
