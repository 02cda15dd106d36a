"""Stateful property test of `UnifiedRadixCache` (design.md §3 "Accounting is exact"):
random request lifecycles (match_prefix, alloc_request, append_tokens, add_checkpoint,
release_out_of_window, cache_unfinished, cache_finished with sessions, release,
close_session, flush, evict) over FULL + SWA + MAMBA with accounting-only pools.

After every step each handle must be exactly one of: free in its pool, owned by a live
`RequestState` (its pages from `prefix_len // page_size` on that are >= 0, its state
slot, its checkpoints), or held by the tree. A live request's pages below `prefix_len`
are the tree's, and must still be there, locked.
"""
from __future__ import annotations

import sys

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from uniradix.cache import audit, CacheFull, UnifiedRadixCache
from uniradix.memory import KVPool, MambaStatePool
from uniradix.tree import FullComponent, MambaComponent, RadixTree, SWAComponent, decode

NAMES = ("full", "swa", "mamba")
FULL, SWA, MAMBA = 0, 1, 2
TOKEN = st.integers(0, 2)
# (earlier sequence to reuse, negative for a fresh one; tokens dropped from its end; new tokens)
TOKENS = st.tuples(st.integers(-6, 23), st.sampled_from([0, 0, 0, 1, 2, 3, 5, 8]),
                   st.lists(TOKEN, max_size=16))
SALT = st.sampled_from(["same", "same", "same", None, "tenant-a", "tenant-b"])
PRIORITY = st.sampled_from([None, 0, 1, 2, 3])
PICK = st.integers(0, 63)
CAPTURE = st.sampled_from([True, True, False])
MAX_LIVE = 4


def tree_handles(tree):
    """Per component, every handle the tree's attached nodes hold, and the nodes."""
    held = ([], [], [])
    nodes = []
    stack = [c for r in tree.roots.values() for c in r.children.values()]
    while stack:
        x = stack.pop()
        nodes.append(x)
        for ci in range(3):
            if x.value[ci] is not None:
                held[ci].extend(x.value[ci])
        stack.extend(x.children.values())
    return held, nodes


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None

    @initialize(
        page=st.sampled_from([1, 2, 4]),
        window=st.integers(1, 8),
        keep_all=st.booleans(),
        policy=st.sampled_from(["lru", "lfu", "fifo", "priority"]),
        full_size=st.integers(32, 96),
        swa_size=st.integers(32, 96),
        mamba_size=st.integers(12, 48),
    )
    def setup(self, page, window, keep_all, policy, full_size, swa_size, mamba_size):
        self.P, self.W = page, window
        tree = RadixTree([FullComponent(), SWAComponent(window, keep_all=keep_all), MambaComponent()],
                         page_size=page, eviction_policy=policy)
        self.pools = [
            KVPool([0], full_size, page, 1, 2, accounting_only=True, name="full"),
            KVPool([1], swa_size, page, 1, 2, accounting_only=True, name="swa"),
            MambaStatePool([2], mamba_size, (3,), (2, 2), accounting_only=True),
        ]
        self.cache = UnifiedRadixCache(tree, dict(zip(NAMES, self.pools)))
        self.tree = tree
        self.live: list = []
        self.sessions: set = set()
        self.history: list[tuple] = []

    # ------------------------------------------------------------------ helpers
    def tokens(self, spec, salt):
        idx, drop, new = spec
        if idx < 0 or not self.history:
            return list(new) + [0] * (self.P - len(new)), (None if salt == "same" else salt)
        base_salt, base = self.history[idx % len(self.history)]
        return base[:max(0, len(base) - drop)] + list(new), (base_salt if salt == "same" else salt)

    def used(self):
        return [p.allocator.used for p in self.pools]

    def pick(self, i):
        return self.live[i % len(self.live)]

    def toks(self, req):
        return decode(req.key)

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(tokens=TOKENS, salt=SALT, prio=PRIORITY, alloc=st.booleans())
    def start(self, tokens, salt, prio, alloc):
        """match_prefix, then alloc_request (or both at once with alloc=True)."""
        toks, salt = self.tokens(tokens, salt)
        before, locked = self.used(), list(self.tree.locked)
        try:
            req = self.cache.match_prefix(toks, salt, prio, alloc=True) if alloc else \
                self.cache.match_prefix(toks, salt, prio)
        except CacheFull:
            assert all(u <= b for u, b in zip(self.used(), before)), "CacheFull allocated something"
            assert self.tree.locked == locked, "CacheFull left something locked"
            return
        P = self.P
        assert req.prefix_len == req.reused and req.prefix_len % P == 0
        assert req.node.end == req.prefix_len
        assert req.state_slot is not None
        assert req.computed == (req.prefix_len if req.node.value[MAMBA] is not None and req.prefix_len else 0)
        # what the request reuses is what the tree holds on its path, up to the boundary
        full, swa = {}, {}
        x = req.node
        while x.parent is not None:
            for i in range((x.end - x.start) // P):
                full[x.start // P + i] = x.value[FULL][i]
                swa[x.start // P + i] = x.value[SWA][i] if x.value[SWA] is not None else -1
            x = x.parent
        b = req.prefix_len // P
        assert list(req.pages["full"][:b]) == [full[i] for i in range(b)]
        lo = max(0, req.prefix_len - self.W + 1) // P
        assert list(req.pages["swa"][:b]) == [-1] * lo + [swa[i] for i in range(lo, b)]
        if not alloc:
            try:
                self.cache.alloc_request(req)
            except CacheFull:
                self.cache.release(req)
                return
        self.live.append(req)

    @precondition(lambda self: self.live)
    @rule(pick=PICK, add=st.lists(TOKEN, min_size=1, max_size=6))
    def decode(self, pick, add):
        req = self.pick(pick)
        try:
            self.cache.append_tokens(req, add)
        except CacheFull:
            self.cache.release(req)
            self.live.remove(req)

    @precondition(lambda self: self.live)
    @rule(pick=PICK, where=st.sampled_from(["end", "junction", "any"]), k=st.integers(0, 6))
    def checkpoint(self, pick, where, k):
        """The engine captures the recurrent state at a page end into a request-owned slot
        (at the aligned end, at the junction, or anywhere up to the end)."""
        req = self.pick(pick)
        P = self.P
        n = req.allocated // P * P
        pos = {"end": n, "junction": req.junction, "any": min(k * P, n)}[where]
        if pos == 0:
            return
        try:
            self.cache.add_checkpoint(req, pos)
        except CacheFull:
            pass

    @precondition(lambda self: self.live)
    @rule(pick=PICK)
    def state_at_end(self, pick):
        """The engine has computed every token: its private state is valid at the end."""
        req = self.pick(pick)
        req.computed = req.allocated

    @precondition(lambda self: self.live)
    @rule(pick=PICK)
    def release_window(self, pick):
        req = self.pick(pick)
        P = self.P
        before = list(req.pages["swa"])
        freed = self.cache.release_out_of_window(req)
        after = list(req.pages["swa"])
        gone = [p for p, (h0, h1) in enumerate(zip(before, after)) if h0 != h1]
        assert len(gone) == freed and all(after[p] == -1 for p in gone), (
            f"release_out_of_window said {freed} freed, the pages show {gone}")
        # only its own pages, never the window it still decodes with, nor the junction's
        jlo, jhi = max(0, req.junction - self.W + 1) // P, req.junction // P
        for p in gone:
            assert p >= req.prefix_len // P, f"freed the tree's SWA page {p}"
            assert (p + 1) * P <= req.allocated - self.W + 1, f"freed SWA page {p} inside the window"
            assert not jlo <= p < jhi, f"freed SWA page {p} of the junction window"

    def capture_end(self, req):
        """The engine captures the state at the aligned end (what the tree will keep)."""
        n = req.allocated // self.P * self.P
        if n:
            try:
                self.cache.add_checkpoint(req, n)
            except CacheFull:
                pass

    @precondition(lambda self: self.live)
    @rule(pick=PICK, capture=CAPTURE)
    def cache_unfinished(self, pick, capture):
        req = self.pick(pick)
        if capture:
            self.capture_end(req)
        self.cache.cache_unfinished(req)
        assert req.prefix_len == req.allocated // self.P * self.P
        self.remember(req)

    @precondition(lambda self: self.live)
    @rule(pick=PICK, sid=st.one_of(st.none(), st.integers(0, 2)), capture=CAPTURE)
    def cache_finished(self, pick, sid, capture):
        req = self.pick(pick)
        if capture:
            self.capture_end(req)
        self.remember(req)
        node = self.cache.cache_finished(req, session_id=sid)
        self.live.remove(req)
        assert not req.held
        if sid is not None and node.parent is not None:
            self.sessions.add((sid, req.salt))  # a session is its tenant's: (id, salt)

    @precondition(lambda self: self.live)
    @rule(pick=PICK)
    def release(self, pick):
        req = self.pick(pick)
        self.cache.release(req)
        self.live.remove(req)

    @precondition(lambda self: self.sessions)
    @rule(sid=st.integers(0, 2), salt=st.sampled_from([None, "tenant-a", "tenant-b"]))
    def close_session(self, sid, salt):
        assert self.cache.close_session(sid, salt) == ((sid, salt) in self.sessions)
        self.sessions.discard((sid, salt))

    @precondition(lambda self: self.tree.num_nodes)
    @rule(what=st.sampled_from(["full_pages", "swa_pages", "mamba_slots"] * 3 + ["flush"]),
          k=st.sampled_from([1, 0, 2, 4, 1, 2, 10**6]))
    def evict(self, what, k):
        """Evict k handles of one component, or flush (refused while anything is locked)."""
        if what == "flush":
            locked = any(self.tree.locked)
            done = self.cache.flush()
            assert done == (not locked)
            if done:
                assert self.tree.num_nodes == 0 and not self.tree.sessions, "flush left data"
                assert self.tree.size == [0, 0, 0], f"flush left handles: {self.tree.size}"
                self.sessions.clear()
            return
        ev = self.cache.evict(**{what: k})
        name = what.split("_")[0]
        if len(ev.freed[name]) < k:
            assert self.tree.evictable(name) == 0

    def remember(self, req):
        t = self.toks(req)
        if t and (req.salt, t) not in self.history:
            self.history.append((req.salt, t))
            del self.history[:-24]

    # ------------------------------------------------------------------ invariants
    @invariant()
    def accounting_is_exact(self):
        if self.cache is None:
            return
        P = self.P
        audit(self.cache, self.live)  # every handle owned once, counts and locks exact
        held, nodes = tree_handles(self.tree)
        for req in self.live:
            assert req.held and not req.receipt.released
            for name in ("full", "swa"):
                pages = req.pages[name]
                assert len(pages) == -(-req.allocated // P), f"{name} pages do not cover the request"
        for ci in range(3):
            self.pools[ci].allocator.check()
        # a live request's FULL pages below prefix_len are the tree's, and pinned
        tree_full = set(held[FULL])
        locked_full = {h for x in nodes if x.locks[FULL] for h in x.value[FULL]}
        for req in self.live:
            mine = list(req.pages["full"][:req.prefix_len // P])
            assert all(h in tree_full for h in mine), f"{req}: reuses FULL pages the tree no longer holds"
            assert all(h in locked_full for h in mine), f"{req}: reuses FULL pages nobody locks"

    def teardown(self):
        """Release every request, close every session, flush: all pools end empty."""
        if self.cache is None or sys.exc_info()[0] is not None:
            return
        for req in list(self.live):
            self.cache.release(req)
        self.live = []
        self.accounting_is_exact()
        for sid, salt in list(self.sessions):
            assert self.cache.close_session(sid, salt), f"session {sid} of {salt!r} was not open"
        assert self.cache.flush(), "flush refused with no request running"
        assert self.tree.num_nodes == 0, f"flush left {self.tree.num_nodes} nodes"
        for p in self.pools:
            assert p.allocator.used == 0, f"{p.name}: {p.allocator.used} handles never came back"


_ALL_CHECKS = list(HealthCheck)

TestCacheStateful = CacheMachine.TestCase
TestCacheStateful.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                      suppress_health_check=_ALL_CHECKS)


@pytest.mark.slow
class TestCacheStatefulSlow(CacheMachine.TestCase):
    settings = settings(max_examples=2000, stateful_step_count=120, deadline=None,
                        suppress_health_check=_ALL_CHECKS)


def test_release_out_of_window_keeps_the_window_at_the_cached_end():
    """design.md §3 Retention: what a finished request leaves is its page-aligned part, and
    its SWA KV is worth keeping for the window at that cached end. Freeing pages of that
    window while decoding (counting the window from the unaligned last token) leaves a
    cached end that no later request can resume from."""
    P, W = 4, 2
    tree = RadixTree([FullComponent(), SWAComponent(W), MambaComponent()], page_size=P)
    pools = {"full": KVPool([0], 16, P, 1, 2, accounting_only=True, name="full"),
             "swa": KVPool([1], 16, P, 1, 2, accounting_only=True, name="swa"),
             "mamba": MambaStatePool([2], 8, (3,), (2, 2), accounting_only=True)}
    cache = UnifiedRadixCache(tree, pools)
    tokens = list(range(100, 111))              # 11 tokens: the cached end is 8
    req = cache.match_prefix(tokens)
    cache.alloc_request(req)
    cache.add_checkpoint(req, 8)                # the state at the cached end is captured
    cache.release_out_of_window(req)            # decoding goes on at token 11
    cache.cache_finished(req)
    again = cache.match_prefix(tokens[:8])
    assert again.prefix_len == 8, (
        f"the finished request's cached end (8) cannot be resumed: reuse stops at "
        f"{again.prefix_len}; release_out_of_window freed a page of the window [6, 8)")
