"""Stateful property test of the tree core (DESIGN §3, §6): random requests, matches,
locks, evictions and sessions over FULL + SWA + MAMBA, with real `HandleAllocator`s as
the free lists, and the §3 rules checked after every step.

The driver plays the engine. A request matches, locks what it reuses (tree-owned), and
allocates its own FULL/SWA pages, a private MAMBA state slot and some checkpoint slots.
It may grow, free its out-of-window SWA pages, be inserted while still running (insert
with `lock=True`, then it goes on from the tree's copy) or when finished (its state
slot becomes the checkpoint at its end), or be aborted. Whatever the tree hands back
(`InsertResult.free`, `EvictResult.freed`, `unlock`) goes back to the allocators.

Every check reads the nodes' raw fields (spans, keys, values, lock counts) and
re-derives what the tree should hold from this driver's own records; it never asks a
component's rule methods, so a wrong rule cannot vouch for itself.
"""
from __future__ import annotations

import copy
import sys
from array import array
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from uniradix.memory import HandleAllocator
from uniradix.tree import FullComponent, LockError, MambaComponent, RadixTree, SWAComponent, decode

import helpers  # tests/tree is on sys.path: pytest prepends a test file's folder

FULL, SWA, MAMBA = 0, 1, 2
NAMES = ("full", "swa", "mamba")
EVICT_KW = ("full_pages", "swa_pages", "mamba_slots")
TOKEN = st.integers(0, 2)          # a small alphabet, so prefixes are shared
# a request's tokens: (earlier sequence to reuse, negative for a fresh one; tokens dropped
# from its end; new tokens)
TOKENS = st.tuples(st.integers(-6, 23), st.sampled_from([0, 0, 0, 1, 2, 3, 5, 8]),
                   st.lists(TOKEN, max_size=16))
# the cache salt: that of the reused sequence, or a given one (a different salt must not reuse)
SALT = st.sampled_from(["same", "same", "same", None, "tenant-a", "tenant-b"])
PRIORITY = st.sampled_from([None, 0, 1, 2, 3])
PAGE_PICKS = st.lists(st.integers(0, 4), max_size=3, unique=True)  # checkpoints, as page offsets
JMODE = st.sampled_from(["matched", "none", "any"])                # the junction an insert passes
END_CKPT = st.sampled_from([True, True, False])                    # capture the state at the end
SID = st.one_of(st.none(), st.integers(0, 2))                      # a session to reference the end
PICK = st.integers(0, 63)                                          # which request/receipt/node
MAX_REQS = 4
MAX_HELD = 5
HUGE = 10**6
PROBE_POPS = 4  # evictions replayed on a copy of the tree after a step


class Pin:
    """What one lock receipt or session reference pinned, as this driver reads it at
    pin time (DESIGN §3 Locks): the node; per page component the position `lo[ci]` such
    that the pinned slots are those on the chain from the node up that end after it
    (FULL 0, SWA the start of the window: a split copies page locks to the new upper
    part, so that chain stays exactly the pinned span); for MAMBA whether the node's
    own checkpoint was pinned (only that node: a checkpoint never moves, and a split
    leaves the new upper part unpinned); a snapshot of the pinned handles."""

    __slots__ = ("rc", "node", "lo", "snap")

    def __init__(self, rc, node, lo, snap):
        self.rc, self.node, self.lo, self.snap = rc, node, lo, snap

    def __repr__(self):
        return f"Pin({self.node!r})"


class Req:
    """A running request as an engine sees it. Pages below `b // P` are the tree's
    (reused, pinned by `pin`); `own_full` / `own_swa` are its own pages from page
    `b // P` on (-1 where an SWA page was freed); `ckpts` and `state` are its own slots."""

    __slots__ = ("tokens", "salt", "prio", "b", "matched", "pin", "tree_full", "tree_swa",
                 "own_full", "own_swa", "ckpts", "state", "rid")

    def __repr__(self):
        return f"Req#{self.rid}(len={len(self.tokens)}, b={self.b}, salt={self.salt!r})"


def chain_pages(node, ci, lo, P):
    """page index -> handle of component ci on the chain from node up, nodes ending after lo."""
    out = {}
    x = node
    while x.parent is not None and x.end > lo:
        v = x.value[ci]
        if v is not None:
            for i, h in enumerate(v):
                out[x.start // P + i] = h
        x = x.parent
    return out


def check_pinned(pins, P):
    """Locked data was never evicted: every node a live receipt pinned is attached and
    still holds the handles it held when pinned."""
    for pin in pins:
        if pin.lo is None:
            continue
        x = pin.node
        while x.parent is not None:
            assert x.attached, f"a node locked by a live receipt was removed: {x}"
            x = x.parent
        for ci in (FULL, SWA):
            now = chain_pages(pin.node, ci, pin.lo[ci], P)
            lost = {p: h for p, h in pin.snap[ci].items() if now.get(p) != h}
            assert not lost, f"{NAMES[ci]} pages pinned by a live receipt are gone: {lost}"
        if pin.lo[MAMBA]:
            v = pin.node.value[MAMBA]
            assert v is not None and v[0] == pin.snap[2], "a locked checkpoint was evicted"


class RadixTreeMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tree = None

    # ------------------------------------------------------------------ set-up
    @initialize(
        page=st.sampled_from([1, 2, 4]),
        window=st.integers(2, 8),
        keep_all=st.booleans(),
        policy=st.sampled_from(["lru", "lfu", "fifo", "priority"]),
        full_size=st.integers(40, 96),
        swa_size=st.integers(40, 96),
        mamba_size=st.integers(16, 48),
    )
    def setup(self, page, window, keep_all, policy, full_size, swa_size, mamba_size):
        self.P, self.W, self.keep_all, self.policy = page, window, keep_all, policy
        self.tree = RadixTree([FullComponent(), SWAComponent(window, keep_all=keep_all),
                               MambaComponent()], page_size=page, eviction_policy=policy)
        self.allocs = [HandleAllocator(full_size, "full"), HandleAllocator(swa_size, "swa"),
                       HandleAllocator(mamba_size, "mamba")]
        self.reqs: list[Req] = []
        self.held: list[Pin] = []
        self.released: list = []
        self.sessions: dict[int, Pin] = {}
        self.history: list[tuple] = []  # (salt, tokens) of inserted requests
        self.evicted = [0, 0, 0]
        self.next_rid = 0
        self.steps = 0

    # ------------------------------------------------------------------ helpers
    def window_start(self, b: int) -> int:
        """First token of the first page touching [max(0, b - W), b) (DESIGN §3 SWA)."""
        return max(0, b - self.W) // self.P * self.P

    def tokens(self, spec, salt):
        """(tokens, salt) of a request from (earlier sequence to reuse or < 0, tokens dropped
        from its end, new tokens) and SALT: mostly a cut of an earlier sequence plus a new
        tail, so paths are shared. A fresh sequence has at least one page."""
        idx, drop, new = spec
        if idx < 0 or not self.history:
            return list(new) + [0] * (self.P - len(new)), (None if salt == "same" else salt)
        base_salt, base = self.history[idx % len(self.history)]
        return base[:max(0, len(base) - drop)] + list(new), (base_salt if salt == "same" else salt)

    def remember(self, salt, tokens):
        if tokens and (salt, tokens) not in self.history:
            self.history.append((salt, list(tokens)))
            del self.history[:-24]

    def free(self, handles: dict) -> None:
        """Give what the tree handed back to the allocators (DoubleFree = a bug)."""
        for ci, name in enumerate(NAMES):
            h = handles[name]
            if len(h):
                self.allocs[ci].free(array("i", h))

    def make_pin(self, node, rc):
        if node.parent is None:
            return Pin(rc, node, None, None)
        P = self.P
        mamba = node.value[MAMBA] is not None
        lo = (0, self.window_start(node.end), mamba)
        snap = (chain_pages(node, FULL, lo[0], P), chain_pages(node, SWA, lo[1], P),
                node.value[MAMBA][0] if mamba else None)
        return Pin(rc, node, lo, snap)

    def unlock(self, pin) -> None:
        gone = self.tree.unlock(pin.rc)
        if gone:
            self.free(gone)
        self.released.append(pin.rc)

    def all_nodes(self):
        return helpers.all_nodes(self.tree)

    def brute_path(self, root, tokens):
        """Nodes along tokens (page by page, comparing decoded keys) and how far they match."""
        P = self.P
        n = len(tokens) // P * P
        path, off, x = [], 0, root
        while x is not None and off < n:
            hit = None
            for c in x.children.values():
                ct = decode(c.key)
                k = 0
                while k + P <= len(ct) and off + k + P <= n and ct[k:k + P] == tokens[off + k:off + k + P]:
                    k += P
                if k:
                    assert hit is None, f"two children of {x} share the first page {ct[:P]}"
                    hit = (c, k, len(ct))
            if hit is None:
                break
            c, k, length = hit
            path.append(c)
            off += k
            if k < length:
                break
            x = c
        return path, off

    def expected_match(self, salt, tokens):
        """The §3 boundary rule by brute force on per-page presence along the path."""
        P, W = self.P, self.W
        path, matched = self.brute_path(self.tree.roots.get(salt), tokens)
        full, swa, ck = [], [], {}
        for x in path:
            npg = (x.end - x.start) // P
            full += list(x.value[FULL]) if x.value[FULL] is not None else [None] * npg
            swa += list(x.value[SWA]) if x.value[SWA] is not None else [None] * npg
            if x.value[MAMBA] is not None and x.end <= matched:
                ck[x.end] = x.value[MAMBA][0]
        full, swa = full[:matched // P], swa[:matched // P]

        def full_ok(b):
            return all(h is not None for h in full[:b // P])

        def swa_ok(b):
            return all(h is not None for h in swa[max(0, b - W) // P: b // P])

        def mamba_ok(b):
            return b == 0 or b in ck

        bs = range(0, matched + 1, P)
        best = max(b for b in bs if full_ok(b) and swa_ok(b) and mamba_ok(b))
        deepest = {"full": max(b for b in bs if full_ok(b)), "swa": max(b for b in bs if swa_ok(b)),
                   "mamba": max(b for b in bs if mamba_ok(b))}
        handles = {"full": full[:best // P], "swa": swa[max(0, best - W) // P: best // P],
                   "mamba": [ck[best]] if best else []}
        return matched, best, deepest, handles

    def match(self, tokens, salt, prio, lock=False):
        """tree.match, checked against the brute-force rule computed before it."""
        matched, best, deepest, handles = self.expected_match(salt, tokens)
        m = self.tree.match(tokens, salt, prio, lock=True) if lock else self.tree.match(tokens, salt, prio)
        assert m.matched == matched, f"matched {m.matched}, brute force {matched}"
        assert m.boundary == best, (
            f"boundary {m.boundary}, but the deepest boundary every component accepts is {best}"
            f" (matched {matched}, per component {deepest})")
        assert m.deepest == deepest
        for name in NAMES:
            assert list(m.handles[name]) == handles[name], f"{name} handles at {best}"
        root = self.tree.roots[salt]
        assert m.node.end == best
        x = m.node
        while x.parent is not None:
            assert x.attached
            x = x.parent
        assert x is root, "match ended under another salt's root"
        # salts never share: every handle returned lives under this salt's root
        mine = set()
        stack = [root]
        while stack:
            y = stack.pop()
            for ci in range(3):
                if y.value[ci] is not None:
                    mine.update((ci, h) for h in y.value[ci])
            stack.extend(y.children.values())
        for ci, name in enumerate(NAMES):
            assert all((ci, h) in mine for h in m.handles[name]), f"{name} handle from another salt"
        return m

    def alloc(self, counts: dict):
        """Allocate like an engine: evict the shortfall first; None when locked data
        leaves too little (nothing allocated then)."""
        for ci, k in counts.items():
            short = k - self.allocs[ci].available
            if short > 0:
                self.evict(ci, short)
        if any(self.allocs[ci].available < k for ci, k in counts.items()):
            return None
        return {ci: list(self.allocs[ci].alloc(k)) for ci, k in counts.items()}

    def rank(self, x, ci):
        """DESIGN §3: (has session references, number of references, base policy)."""
        p = self.policy
        bk = (x.tick if p == "lru" else x.created if p == "fifo"
              else (x.hits, x.tick) if p == "lfu" else (x.priority, x.tick))
        return (1, x.refs[ci], bk) if x.refs[ci] else (0, 0, bk)

    def evict(self, ci: int, k: int):
        ev = self.checked_evict(self.tree, ci, k)
        self.free(ev.freed)
        for c, name in enumerate(NAMES):
            self.evicted[c] += len(ev.freed[name])
        return ev

    def checked_evict(self, tree, ci: int, k: int):
        """tree.evict for one component, checking that it starts with a best-ranked slot
        and stops short only when nothing unlocked is left."""
        def nodes():
            out, stack = [], [c for r in tree.roots.values() for c in r.children.values()]
            while stack:
                x = stack.pop()
                out.append(x)
                stack.extend(x.children.values())
            return out

        cands = [x for x in nodes() if x.value[ci] is not None and x.locks[ci] == 0
                 and (ci != FULL or not x.children)]
        before = {x: list(x.value[ci]) for x in cands}
        ranks = {x: self.rank(x, ci) for x in cands}
        ev = tree.evict(**{EVICT_KW[ci]: k})
        got = ev.freed[NAMES[ci]]
        if k == 0:
            assert not any(len(ev.freed[name]) for name in NAMES), "evict(0) freed something"
            return ev
        if cands:
            best = min(ranks.values())
            first = [x for x in cands if ranks[x] == best]
            gone = set(got)
            if not any(set(before[x]) <= gone for x in first):
                went = {x: ranks[x] for x in cands if set(before[x]) <= gone}
                raise AssertionError(
                    f"{self.policy}: evict({EVICT_KW[ci]}={k}) passed over the best-ranked slot(s) "
                    f"{first} (rank (has refs, refs, base key) = {best}); it took {went}")
        if len(got) < k:
            left = [x for x in nodes() if x.value[ci] is not None and x.locks[ci] == 0]
            assert not left, (f"evict({EVICT_KW[ci]}={k}) freed only {len(got)} while unlocked "
                              f"slots remain: {left}")
        return ev

    # ------------------------------------------------------------------ requests
    def page_ends(self, lo: int, hi: int, picks) -> list[int]:
        """Checkpoint positions: page ends in [lo, hi] picked by offset (in pages)."""
        ends = list(range(lo, hi + 1, self.P))
        return sorted({ends[i] for i in picks if i < len(ends)})

    def begin(self, tokens, salt, prio, ck, jck):
        """Match, lock what is reused, allocate own pages, a state slot and checkpoint
        slots (at page ends from the boundary on; with jck also at the junction)."""
        P = self.P
        m = self.match(tokens, salt, prio)
        pin = self.make_pin(m.node, self.tree.lock(m.node))
        b, n = m.boundary, len(tokens) // P * P
        ck_pos = self.page_ends(max(b, P), n, ck)
        if jck and m.matched and m.matched not in ck_pos:
            ck_pos.append(m.matched)
        npages = -(-len(tokens) // P) - b // P
        got = self.alloc({FULL: npages, SWA: npages, MAMBA: 1 + len(ck_pos)})
        if got is None:
            self.unlock(pin)
            return None
        r = Req()
        r.rid, self.next_rid = self.next_rid, self.next_rid + 1
        r.tokens, r.salt, r.prio, r.b, r.matched, r.pin = list(tokens), salt, prio, b, m.matched, pin
        r.tree_full = list(m.handles["full"])
        swa_h = list(m.handles["swa"])
        r.tree_swa = [-1] * (b // P - len(swa_h)) + swa_h
        r.own_full, r.own_swa = got[FULL], got[SWA]
        r.state = got[MAMBA][0]
        r.ckpts = dict(zip(ck_pos, got[MAMBA][1:]))
        self.reqs.append(r)
        return r

    def extend(self, r, add, ck):
        """Decode: more tokens, more own pages, maybe checkpoints at new page ends."""
        P = self.P
        toks = r.tokens + list(add)
        ck_pos = self.page_ends(len(r.tokens) // P * P + P, len(toks) // P * P, ck)
        need = -(-len(toks) // P) - (r.b // P + len(r.own_full))
        got = self.alloc({FULL: need, SWA: need, MAMBA: len(ck_pos)})
        if got is None:
            return
        r.tokens = toks
        r.own_full += got[FULL]
        r.own_swa += got[SWA]
        r.ckpts.update(zip(ck_pos, got[MAMBA]))

    def release_swa(self, r, mode, picks=()):
        """Free own SWA pages: the engine's rule (pages out of the window at the request's
        page-aligned end, which is what the tree will keep, except the junction's window),
        or an arbitrary subset (the tree must cope with any -1 pattern)."""
        P = self.P
        bp = r.b // P
        live = [i for i, h in enumerate(r.own_swa) if h >= 0]
        if mode == "engine":
            stop = self.window_start(len(r.tokens) // P * P) // P
            jlo, jhi = self.window_start(r.matched) // P, r.matched // P
            pick = [i for i in live if bp + i < stop and not jlo <= bp + i < jhi]
        elif mode == "random" and live:
            pick = sorted({live[i % len(live)] for i in picks})
        else:
            pick = []
        if pick:
            self.allocs[SWA].free(array("i", [r.own_swa[i] for i in pick]))
            for i in pick:
                r.own_swa[i] = -1

    def insert(self, r, running, jmode, junction, end_ckpt, sid):
        """Insert the request's aligned part. running: lock=True and the request goes on
        from the tree's copy; else it is finished (its state slot is the end checkpoint;
        with sid its session references the end)."""
        P = self.P
        n = len(r.tokens) // P * P
        npg, bp = n // P, r.b // P
        j = {"matched": r.matched, "none": None, "any": junction % (n + 1)}[jmode]
        full_in = r.tree_full + r.own_full[:npg - bp]
        swa_in = r.tree_swa + r.own_swa[:npg - bp]
        ck = dict(r.ckpts)
        r.ckpts = {}
        if not running and r.state is not None and len(r.tokens) == n and n and n not in ck:
            ck[n] = r.state
            r.state = None
        passed_swa = {bp + i: h for i, h in enumerate(r.own_swa[:npg - bp]) if h >= 0}
        r.own_full, r.own_swa = r.own_full[npg - bp:], r.own_swa[npg - bp:]
        if end_ckpt and n and n not in ck:
            got = self.alloc({MAMBA: 1})  # the engine captures the state at the aligned end
            if got is not None:
                ck[n] = got[MAMBA][0]
        path, pre = self.brute_path(self.tree.roots.get(r.salt), r.tokens)
        ws = self.window_start(n)
        tree_swa = chain_pages(path[-1], SWA, ws, P) if path else {}
        # the request brings everything a later request needs to resume at its end: the
        # checkpoint at n and the SWA window before n (its own pages, the tree's below b)
        resumable = (not running and n > 0 and n in ck and pre == r.b
                     and all(p in tree_swa for p in range(ws // P, bp))
                     and all(p in passed_swa for p in range(max(ws // P, bp), npg)))
        res = self.tree.insert(r.tokens, {"full": array("i", full_in), "swa": array("i", swa_in),
                                          "mamba": ck},
                               prefix_len=r.b, junction=j, salt=r.salt, priority=r.prio, lock=running)
        self.free(res.free)
        assert res.existing == pre and res.existing >= r.b, (res.existing, pre, r.b)
        if not self.keep_all:
            # DESIGN §3 Retention: of this insert's SWA pages the tree keeps only those in
            # the window at the end and the window at the junction
            spans = [(self.window_start(n), n)]
            if j:
                jj = min(j, n) // P * P
                spans.append((self.window_start(jj), jj))
            kept = {h for x in self.all_nodes() if x.value[SWA] is not None for h in x.value[SWA]}
            for p, h in passed_swa.items():
                if h in kept:
                    assert any(lo <= p * P and (p + 1) * P <= hi for lo, hi in spans), (
                        f"SWA page {p} kept outside the retention windows {spans}")
        if resumable:
            # DESIGN §3 Retention: the window at the end of a cached sequence is kept
            assert res.node.end == n and res.node.attached, (
                f"a finished request brought its checkpoint at {n} and the SWA window "
                f"[{ws}, {n}), yet nothing past {res.node.end} was cached (keep_all={self.keep_all})")
        old = r.pin
        self.remember(r.salt, r.tokens)
        if running:
            node = res.receipt.node
            assert node is res.node and node.end == n
            r.pin = self.make_pin(node, res.receipt)
            self.unlock(old)
            r.b = n
            r.tree_full = [chain_pages(node, FULL, 0, P).get(i, -1) for i in range(npg)]
            swa = chain_pages(node, SWA, 0, P)
            r.tree_swa = [swa.get(i, -1) for i in range(npg)]
            assert -1 not in r.tree_full
        else:
            assert res.receipt is None
            self.unlock(old)
            self.reqs.remove(r)
            self.allocs[FULL].free(array("i", r.own_full))
            self.allocs[SWA].free(array("i", [h for h in r.own_swa if h >= 0]))
            if r.state is not None:
                self.allocs[MAMBA].free(array("i", [r.state]))
            if sid is not None:
                self.tree.register_session(sid, res.node)
                self.sessions[sid] = self.make_pin(res.node, None)

    def abort(self, r):
        self.reqs.remove(r)
        self.allocs[FULL].free(array("i", r.own_full))
        self.allocs[SWA].free(array("i", [h for h in r.own_swa if h >= 0]))
        slots = list(r.ckpts.values()) + ([r.state] if r.state is not None else [])
        self.allocs[MAMBA].free(array("i", slots))
        self.unlock(r.pin)

    @precondition(lambda self: len(self.reqs) < MAX_REQS)
    @rule(tokens=TOKENS, salt=SALT, prio=PRIORITY, ck=PAGE_PICKS, jck=st.booleans(),
          decode=st.lists(st.tuples(st.lists(TOKEN, min_size=1, max_size=6), PAGE_PICKS), max_size=2),
          jmode=JMODE, junction=st.integers(0, 32), end_ckpt=END_CKPT, sid=SID)
    def serve_request(self, tokens, salt, prio, ck, jck, decode, jmode, junction, end_ckpt, sid):
        """A whole request in one step: start, decode a little, finish."""
        r = self.begin(*self.tokens(tokens, salt), prio, ck, jck)
        if r is None:
            return
        for add, more in decode:
            self.extend(r, add, more)
            self.release_swa(r, "engine")
        self.insert(r, False, jmode, junction, end_ckpt, sid)

    @precondition(lambda self: len(self.reqs) < MAX_REQS)
    @rule(tokens=TOKENS, salt=SALT, prio=PRIORITY, ck=PAGE_PICKS, jck=st.booleans())
    def start_request(self, tokens, salt, prio, ck, jck):
        self.begin(*self.tokens(tokens, salt), prio, ck, jck)

    @precondition(lambda self: self.reqs)
    @rule(pick=PICK, add=st.lists(TOKEN, min_size=1, max_size=6), ck=PAGE_PICKS,
          release=st.sampled_from(["no", "engine", "random"]), drop=st.lists(PICK, max_size=4))
    def decode_request(self, pick, add, ck, release, drop):
        r = self.reqs[pick % len(self.reqs)]
        self.extend(r, add, ck)
        self.release_swa(r, release, drop)

    @precondition(lambda self: self.reqs)
    @rule(pick=PICK, running=st.booleans(), jmode=JMODE, junction=st.integers(0, 32),
          end_ckpt=st.booleans(), sid=SID)
    def insert_request(self, pick, running, jmode, junction, end_ckpt, sid):
        self.insert(self.reqs[pick % len(self.reqs)], running, jmode, junction, end_ckpt, sid)

    @precondition(lambda self: self.reqs)
    @rule(pick=PICK)
    def abort_request(self, pick):
        self.abort(self.reqs[pick % len(self.reqs)])

    # ------------------------------------------------------------------ plain matches and locks
    @rule(tokens=TOKENS, salt=SALT, prio=PRIORITY, lock=st.sampled_from(["no", "lock", "match_lock"]))
    def match_tokens(self, tokens, salt, prio, lock):
        """A match under any salt (salt isolation is checked inside); then maybe a lock,
        taken apart (lock(node)) or with the match (match(lock=True))."""
        toks, salt = self.tokens(tokens, salt)
        if lock == "no" or len(self.held) >= MAX_HELD:
            self.match(toks, salt, prio)
        elif lock == "lock":
            m = self.match(toks, salt, prio)
            self.held.append(self.make_pin(m.node, self.tree.lock(m.node)))
        else:
            m = self.match(toks, salt, prio, lock=True)
            assert m.receipt is not None and m.receipt.node is m.node
            self.held.append(self.make_pin(m.node, m.receipt))

    @precondition(lambda self: self.held or self.released)
    @rule(pick=PICK, again=st.booleans())
    def unlock_receipt(self, pick, again):
        """Unlock a held receipt, or unlock a released one again (must raise LockError)."""
        if self.held and not (again and self.released):
            pin = self.held.pop(pick % len(self.held))
            self.unlock(pin)
        else:
            with pytest.raises(LockError):
                self.tree.unlock(self.released[pick % len(self.released)])

    # ------------------------------------------------------------------ eviction
    @precondition(lambda self: self.tree.num_nodes)
    @rule(ci=st.sampled_from([FULL, SWA, MAMBA]), k=st.sampled_from([1, 0, 2, 3, 4, 6, HUGE]))
    def evict_some(self, ci, k):
        self.evict(ci, k)

    # ------------------------------------------------------------------ sessions
    @rule(sid=st.integers(0, 2), close=st.booleans(), pick=PICK)
    def session(self, sid, close, pick):
        if close:
            assert self.tree.close_session(sid) == (sid in self.sessions)
            self.sessions.pop(sid, None)
            return
        nodes = self.all_nodes()
        node = nodes[pick % len(nodes)] if nodes else self.tree.root(None)
        self.tree.register_session(sid, node)
        self.sessions[sid] = self.make_pin(node, None)

    # ------------------------------------------------------------------ invariants
    def owned(self):
        own = ([], [], [])
        for r in self.reqs:
            own[FULL].extend(r.own_full)
            own[SWA].extend(h for h in r.own_swa if h >= 0)
            own[MAMBA].extend(r.ckpts.values())
            if r.state is not None:
                own[MAMBA].append(r.state)
        return own

    def lock_pins(self):
        return [r.pin for r in self.reqs] + self.held

    def expected_counts(self, pins):
        """Per node, per component: how many of these pins cover it (page components:
        the chain up from the pinned node while it ends after lo; MAMBA: the node)."""
        exp = {}
        for pin in pins:
            if pin.lo is None:
                continue
            for ci in (FULL, SWA):
                x = pin.node
                while x.parent is not None and x.end > pin.lo[ci]:
                    exp.setdefault(x, [0, 0, 0])[ci] += 1
                    x = x.parent
            if pin.lo[MAMBA]:
                exp.setdefault(pin.node, [0, 0, 0])[MAMBA] += 1
        return exp

    @invariant()
    def check_everything(self):
        if self.tree is None:
            return
        t, P, W = self.tree, self.P, self.W
        nodes = []
        held = ([], [], [])
        for root in t.roots.values():
            assert root.value == [None] * 3 and root.locks == [0] * 3 and root.refs == [0] * 3
            stack = [root]
            while stack:
                x = stack.pop()
                for k, c in x.children.items():
                    assert c.parent is x and c.attached, c
                    assert c.start == x.end < c.end and c.start % P == 0 and c.end % P == 0, c
                    assert len(c.key) == 4 * (c.end - c.start) and k == c.key[:4 * P], c
                    npg = (c.end - c.start) // P
                    assert c.value[FULL] is not None and len(c.value[FULL]) == npg, f"FULL missing on {c}"
                    assert c.value[SWA] is None or len(c.value[SWA]) == npg, c
                    assert c.value[MAMBA] is None or len(c.value[MAMBA]) == 1, c
                    for ci in range(3):
                        if c.value[ci] is not None:
                            held[ci].extend(c.value[ci])
                    assert min(c.locks) >= 0, f"negative lock count on {c}"
                    assert min(c.refs) >= 0, f"negative session count on {c}: {c.refs}"
                    nodes.append(c)
                    stack.append(c)
        assert t.num_nodes == len(nodes)

        # exact accounting: free list, a running request, or the tree; once each
        own = self.owned()
        for ci, name in enumerate(NAMES):
            a = self.allocs[ci]
            a.check()
            cnt = Counter(held[ci])
            cnt.update(own[ci])
            twice = sorted(h for h, c in cnt.items() if c > 1)
            assert not twice, f"{name}: handles owned twice (tree/request): {twice}"
            allocated = set(a.allocated())
            leaked = sorted(allocated - set(cnt))
            assert not leaked, f"{name}: allocated but owned by nobody (leak): {leaked}"
            stray = sorted(set(cnt) - allocated)
            assert not stray, f"{name}: held by tree/request but free in the allocator: {stray}"
            assert t.size[ci] == len(held[ci]), f"{name}: tree.size {t.size[ci]} != {len(held[ci])}"
            locked = sum(len(x.value[ci]) for x in nodes if x.locks[ci] and x.value[ci] is not None)
            assert t.locked[ci] == locked, f"{name}: tree.locked {t.locked[ci]} != {locked}"
            assert t.evicted[ci] == self.evicted[ci], f"{name}: tree.evicted {t.evicted[ci]} != {self.evicted[ci]}"

        # lock counts and session references are exactly what the live receipts pinned
        exp_l = self.expected_counts(self.lock_pins())
        exp_r = self.expected_counts(self.sessions.values())
        for x in nodes:
            assert x.locks == exp_l.get(x, [0, 0, 0]), (
                f"lock counts {x.locks} on {x}, receipts pinned {exp_l.get(x, [0, 0, 0])}")
            assert x.refs == exp_r.get(x, [0, 0, 0]), (
                f"session refs {x.refs} on {x}, sessions pinned {exp_r.get(x, [0, 0, 0])}")

        # locked data was never evicted
        check_pinned(self.lock_pins(), P)

        # no useless leaf survives unlocked
        for x in nodes:
            if x.children or x.locks[FULL]:
                continue
            swa = chain_pages(x, SWA, self.window_start(x.end), P)
            need = range(self.window_start(x.end) // P, x.end // P)
            assert all(p in swa for p in need), f"unlocked leaf {x} lacks its SWA window (W={W})"
            assert x.value[MAMBA] is not None, f"unlocked leaf {x} has no checkpoint at its end"

        # every evictable slot is on its component's eviction list, in the tier its
        # session references say (Node.where: 1 unreferenced, 2 session-referenced)
        for x in nodes:
            for ci in range(3):
                if x.value[ci] is not None and x.locks[ci] == 0 and (ci != FULL or not x.children):
                    tier = 2 if x.refs[ci] else 1
                    assert x.where[ci] == tier, (
                        f"evictable {NAMES[ci]} slot of {x} (refs {x.refs[ci]}) is in eviction "
                        f"tier {x.where[ci]}, expected {tier}")

        # the eviction order, one slot at a time, on a copy of the tree (one component per
        # step, in turn, when it has a choice to make)
        ci = self.steps % 3
        self.steps += 1
        if sum(x.value[ci] is not None and x.locks[ci] == 0 for x in nodes) > 1:
            probe, pins = copy.deepcopy((t, self.lock_pins()))
            for _ in range(PROBE_POPS):
                if not len(self.checked_evict(probe, ci, 1).freed[NAMES[ci]]):
                    break
            check_pinned(pins, P)

        # each request covers its tokens with pages
        for r in self.reqs:
            assert r.b // P + len(r.own_full) == -(-len(r.tokens) // P) == r.b // P + len(r.own_swa)

    def teardown(self):
        """Release everything, evict everything: the tree must end empty and every
        allocator full (skipped when a step already failed)."""
        if self.tree is None or sys.exc_info()[0] is not None:
            return
        for r in list(self.reqs):
            self.abort(r)
        for pin in self.held:
            self.unlock(pin)
        self.held = []
        for sid in list(self.sessions):
            assert self.tree.close_session(sid), f"session {sid} was not open"
        self.sessions = {}
        self.check_everything()
        for ci in (SWA, MAMBA, FULL):
            self.evict(ci, HUGE)
        t = self.tree
        assert t.num_nodes == 0 and not any(r.children for r in t.roots.values()), (
            f"evicting everything unlocked left {t.num_nodes} nodes")
        assert t.size == [0, 0, 0] and t.locked == [0, 0, 0], f"size {t.size}, locked {t.locked}"
        for a in self.allocs:
            assert a.used == 0, f"{a.name}: {a.used} handles never came back"


_ALL_CHECKS = list(HealthCheck)

TestRadixTreeStateful = RadixTreeMachine.TestCase
TestRadixTreeStateful.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=_ALL_CHECKS)


@pytest.mark.slow
class TestRadixTreeStatefulSlow(RadixTreeMachine.TestCase):
    settings = settings(max_examples=2000, stateful_step_count=120, deadline=None,
                        suppress_health_check=_ALL_CHECKS)
