"""The draft index over the tree's spans (tree/drafts.py): a request's last tokens find what
followed them anywhere in its tenant's cached tree, the most used continuation first,
through splits and across node ends, and nothing that has left the tree: a run held by
several nodes outlives any one of them, and the runs a split moved up outlive the node
that was split. (That it finds every run of the tree and only those through random
inserts, splits and evictions is test_stateful.py's invariant.)"""
from array import array

from uniradix.tree import FullComponent, RadixTree, encode
from uniradix.tree.drafts import DraftIndex


def tree(page=1, gram=2):
    t = RadixTree([FullComponent()], page_size=page)
    t.drafts = DraftIndex(gram)
    return t


def put(t, toks, salt=None, first_handle=0):
    r = t.insert(toks, {"full": array("i", range(first_handle, first_handle + len(toks) // t.page_size))}, salt=salt)
    return r


def test_a_run_is_followed_where_it_occurred():
    t = tree()
    put(t, [1, 2, 3, 4, 5, 6, 7])
    root = t.find_root()
    assert t.drafts.propose(root, encode([2, 3]), 3) == [4, 5, 6]
    assert t.drafts.propose(root, encode([6, 7]), 3) == []          # nothing followed it
    assert t.drafts.propose(root, encode([3, 2]), 3) == []          # never occurred
    assert t.drafts.propose(root, encode([1, 2, 3]), 3) == []       # not a run of GRAM tokens


def test_splits_and_branches_keep_the_continuations():
    t = tree()
    put(t, [1, 2, 3, 4, 5, 6, 7, 8], first_handle=0)
    put(t, [1, 2, 3, 4, 9, 9, 9], first_handle=100)   # splits after 4
    root = t.find_root()
    # past the split point the continuation goes on into a child: the most used one
    for _ in range(3):
        t.match([1, 2, 3, 4, 9, 9], lock=False)
    assert t.drafts.propose(root, encode([3, 4]), 3) == [9, 9, 9]
    for _ in range(5):
        t.match([1, 2, 3, 4, 5, 6, 7], lock=False)
    assert t.drafts.propose(root, encode([3, 4]), 3) == [5, 6, 7]
    assert t.drafts.propose(root, encode([1, 2]), 5) == [3, 4, 5, 6, 7]
    assert t.drafts.propose(root, encode([9, 9]), 2) == [9]          # the run at its second place


def test_tenants_draft_from_their_own_tree_only():
    t = tree()
    put(t, [1, 2, 3, 4, 5], salt="a")
    put(t, [1, 2, 7, 7, 7], salt="b")
    assert t.drafts.propose(t.find_root("a"), encode([1, 2]), 3) == [3, 4, 5]
    assert t.drafts.propose(t.find_root("b"), encode([1, 2]), 3) == [7, 7, 7]
    assert t.drafts.propose(t.find_root(None), encode([1, 2]), 3) == []
    assert t.drafts.propose(None, encode([1, 2]), 3) == []


def test_what_left_the_tree_is_never_drafted():
    t = tree(page=2)
    put(t, [1, 2, 3, 4, 5, 6], first_handle=0)
    root = t.find_root()
    assert t.drafts.propose(root, encode([3, 4]), 2) == [5, 6]
    t.evict(full_pages=3)
    assert t.num_nodes == 0 and len(t.drafts) == 0 and not t.drafts.runs
    assert t.drafts.propose(root, encode([3, 4]), 2) == []


def test_runs_split_off_a_node_outlive_it():
    t = tree()
    put(t, [1, 2, 3, 4, 5, 6, 7, 8], first_handle=0)    # one node; its runs name it
    put(t, [1, 2, 3, 4, 9, 9, 9], first_handle=100)     # splits it after 4: [1..4] is split off it
    t.match([1, 2, 3, 4, 9, 9, 9], lock=False)           # [5..8] is the least recently used leaf
    t.evict(full_pages=4)
    root = t.find_root()
    assert t.drafts.propose(root, encode([5, 6]), 2) == []          # gone with its node
    assert t.drafts.propose(root, encode([4, 5]), 2) == []
    assert t.drafts.propose(root, encode([1, 2]), 5) == [3, 4, 9, 9, 9]   # held by the part split off it
    assert t.drafts.propose(root, encode([3, 4]), 2) == [9, 9]


def test_a_run_held_by_two_nodes_outlives_either():
    t = tree()
    put(t, [1, 2, 3, 4, 5], first_handle=0)
    put(t, [7, 2, 3, 8, 8], first_handle=100)           # another branch with the run [2, 3]
    root = t.find_root()
    for _ in range(2):
        t.match([7, 2, 3, 8, 8], lock=False)
    assert t.drafts.propose(root, encode([2, 3]), 2) == [8, 8]      # the most used place
    t.match([1, 2, 3, 4, 5], lock=False)                 # [7, 2, 3, 8, 8] is the least recently used
    t.evict(full_pages=5)
    assert t.drafts.propose(root, encode([7, 2]), 2) == []
    assert t.drafts.propose(root, encode([2, 3]), 2) == [4, 5]      # still held by the other
    t.evict(full_pages=5)
    assert t.drafts.propose(root, encode([2, 3]), 2) == [] and len(t.drafts) == 0 and not t.drafts.runs
