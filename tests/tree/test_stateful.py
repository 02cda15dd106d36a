"""Stateful property test of the tree core (design.md §3, §4, §6): random requests, matches,
locks, evictions and sessions over FULL + SWA + MAMBA, in two memory tiers (device and
host), with real `HandleAllocator`s as the free lists, and the §3 rules checked after
every step.

The driver plays the engine. A request matches, locks what it reuses (tree-owned), and
allocates its own FULL/SWA pages, a private MAMBA state slot and some checkpoint slots.
It may grow, free its out-of-window SWA pages, be inserted while still running (insert
with `lock=True`, then it goes on from the tree's copy) or when finished (its state
slot becomes the checkpoint at its end), or be aborted. Whatever the tree hands back
(`InsertResult.free`, `EvictResult.freed`, `unlock`) goes back to the allocators, the
host tier's part (`.host`) to the host allocators.

The host tier: the driver backs device slots up (`set_host` with fresh host handles,
chosen at random or as a path's `unbacked()` slots, write-through style), evicts the
host tier (`evict_host`), evicts the device with a write-back `backup` callback that
sometimes hands host handles and sometimes declines, and loads: a match with `lock`
whose `loads` get fresh device handles (`set_device`), after which `handles_at` must
equal the brute force over device data. Matches run with `host=True` (host-only slots
count, and are listed as loads) and `host=False` (device data alone).

Every check reads the nodes' raw fields (spans, keys, values in both tiers, lock counts)
and re-derives what the tree should hold from this driver's own records; it never asks a
component's rule methods, so a wrong rule cannot vouch for itself.
"""
from __future__ import annotations

import copy
import sys
from array import array
from collections import Counter
from itertools import cycle

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from uniradix.memory import HandleAllocator
from uniradix.tree import (Freed, FullComponent, LockError, MambaComponent, RadixTree, SWAComponent,
                           decode)
from uniradix.tree.drafts import DraftIndex

import helpers  # tests/tree is on sys.path: pytest prepends a test file's folder

FULL, SWA, MAMBA = 0, 1, 2
NAMES = ("full", "swa", "mamba")
EVICT_KW = ("full_pages", "swa_pages", "mamba_slots")
TOKEN = st.integers(0, 2)          # a small alphabet, so prefixes are shared
# a request's tokens: (earlier sequence to reuse, negative for a fresh one, from
# TREE_PICK on a cached node's path, often one a host-only slot is on; tokens dropped
# from its end; new tokens)
TREE_PICK = 24
TOKENS = st.tuples(st.integers(-6, 35), st.sampled_from([0, 0, 0, 1, 2, 3, 5, 8]),
                   st.lists(TOKEN, max_size=16))
# the cache salt: that of the reused sequence, or a given one (a different salt must not reuse)
SALT = st.sampled_from(["same", "same", "same", None, "tenant-a", "tenant-b"])
PRIORITY = st.sampled_from([None, 0, 1, 2, 3])
PAGE_PICKS = st.lists(st.integers(0, 4), max_size=3, unique=True)  # checkpoints, as page offsets
JMODE = st.sampled_from(["matched", "none", "any"])                # the junction an insert passes
END_CKPT = st.sampled_from([True, True, False])                    # capture the state at the end
SID = st.one_of(st.none(), st.integers(0, 2))                      # a session to reference the end
PICK = st.integers(0, 63)                                          # which request/receipt/node
# how a request finds its reusable prefix: device data alone (match host=False, then
# lock), or host copies too (match with lock, then load what only the host holds)
BEGIN = st.sampled_from(["device", "load", "load"])
# a write-back callback's answers, cycled: host handles when the host has room (True),
# the same after evicting the host tier's shortfall from inside the callback ("room"),
# or decline (False)
ANSWERS = st.lists(st.sampled_from([True, True, False, "room"]), min_size=1, max_size=4)
HUGE = 10**6
EVICT_K = st.sampled_from([1, 0, 2, 3, 4, 6, HUGE])
EVICT_FEW = st.sampled_from([0, 0, 1, 2, 3, 4, 6, 12])
MAX_REQS = 4
MAX_HELD = 5
PROBE_POPS = 4  # evictions replayed on a copy of the tree after a step
HOST_BASE = 500_000  # host handles live here, so a handle that crosses tiers shows
# A write-back eviction that always agrees (and finds room) takes every unlocked device
# FULL slot, internal ones included (see test_host_tier.py's write-back tests).
STRICT_WRITE_BACK = True


class HostPool:
    """A host tier's free list: a HandleAllocator whose handles are shifted by HOST_BASE,
    so a device handle freed to the host tier (or the reverse) is a DoubleFree or a leak."""

    def __init__(self, size: int, name: str):
        self.a = HandleAllocator(size, name)
        self.name = name

    @property
    def available(self) -> int:
        return self.a.available

    @property
    def used(self) -> int:
        return self.a.used

    def alloc(self, n: int) -> array:
        return array("i", (h + HOST_BASE for h in self.a.alloc(n)))

    def free(self, hs) -> None:
        self.a.free(array("i", (h - HOST_BASE for h in hs)))

    def allocated(self) -> set:
        return {h + HOST_BASE for h in self.a.allocated()}

    def check(self) -> None:
        self.a.check()


class Pin:
    """What one lock receipt or session reference pinned, as this driver reads it at
    pin time (design.md §3 Locks): the node; per page component the position `lo[ci]` such
    that the pinned slots are those on the chain from the node up that end after it
    (FULL 0, SWA the start of the window: a split copies page locks to the new upper
    part, so that chain stays exactly the pinned span); for MAMBA whether the node's
    own checkpoint (in either tier) was pinned (only that node: a checkpoint never
    moves, and a split leaves the new upper part unpinned); a snapshot of the pinned
    handles, per tier: `snap[tier]` = (FULL pages, SWA pages, checkpoint or None)."""

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


def tier_of(x, host: bool) -> list:
    return x.host if host else x.value


def chain_pages(node, ci, lo, P, host: bool = False):
    """page index -> handle of component ci in one tier on the chain from node up, nodes
    ending after lo."""
    out = {}
    x = node
    while x.parent is not None and x.end > lo:
        v = x.host[ci] if host else x.value[ci]
        if v is not None:
            for i, h in enumerate(v):
                out[x.start // P + i] = h
        x = x.parent
    return out


def present_pages(node, ci, lo, P):
    """Pages of component ci present in either tier on the chain from node up past lo."""
    out = set(chain_pages(node, ci, lo, P))
    out.update(chain_pages(node, ci, lo, P, True))
    return out


def check_pinned(pins, P):
    """Locked data was never evicted, in either tier: every node a live receipt pinned is
    attached and each tier still holds the handles it held when pinned (a tier may have
    gained a copy since: a load, a backup)."""
    for pin in pins:
        if pin.lo is None:
            continue
        x = pin.node
        while x.parent is not None:
            assert x.attached, f"a node locked by a live receipt was removed: {x}"
            x = x.parent
        for host in (False, True):
            snap = pin.snap[host]
            tier = "host" if host else "device"
            for ci in (FULL, SWA):
                now = chain_pages(pin.node, ci, pin.lo[ci], P, host)
                lost = {p: h for p, h in snap[ci].items() if now.get(p) != h}
                assert not lost, f"{NAMES[ci]} {tier} pages pinned by a live receipt are gone: {lost}"
            if pin.lo[MAMBA] and snap[2] is not None:
                v = tier_of(pin.node, host)[MAMBA]
                assert v is not None and v[0] == snap[2], f"a locked checkpoint left the {tier} tier"


class RadixTreeMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tree = None

    # ------------------------------------------------------------------ set-up
    @initialize(
        page=st.sampled_from([1, 2, 4]),
        window=st.integers(1, 8),
        retention=st.sampled_from(["windows", "all", "spare"]),
        policy=st.sampled_from(["lru", "lfu", "fifo", "priority"]),
        full_size=st.integers(40, 96),
        swa_size=st.integers(40, 96),
        mamba_size=st.integers(16, 48),
        host_ratio=st.sampled_from([0.5, 1, 2, 2, 3, 4]),
        write_back=st.one_of(st.none(), ANSWERS),
        write_through=st.sampled_from([None, None, 0, 0, 1, 2]),
    )
    def setup(self, page, window, retention, policy, full_size, swa_size, mamba_size, host_ratio,
              write_back, write_through):
        self.P, self.W, self.policy = page, window, policy
        self.keep_all, self.keep_spare = retention == "all", retention == "spare"
        self.tree = RadixTree([FullComponent(), SWAComponent(window, keep_all=self.keep_all,
                                                             keep_spare=self.keep_spare),
                               MambaComponent()], page_size=page, eviction_policy=policy)
        # speculation's draft index, kept in step with every insert, split and removal
        self.tree.drafts = DraftIndex(2)
        self.runs_seen = set()  # every (root, run) a check found in the tree
        self.allocs = [HandleAllocator(full_size, "full"), HandleAllocator(swa_size, "swa"),
                       HandleAllocator(mamba_size, "mamba")]
        # the host tier: a multiple of the device's (design.md §4 --hicache-ratio), or less
        self.hpools = [HostPool(max(8, int(host_ratio * k)), f"host-{n}")
                       for k, n in zip((full_size, swa_size, mamba_size), NAMES)]
        # evictions an allocation needs: plain, or write-back with these answers
        self.write_back = write_back
        # write-through: after an insert, back up the path's unbacked slots (on nodes
        # accessed at least this often); None: off
        self.write_through = write_through
        self.reqs: list[Req] = []
        self.held: list[Pin] = []
        self.released: list = []
        self.sessions: dict[int, Pin] = {}
        self.history: list[tuple] = []  # (salt, tokens) of inserted requests
        self.evicted = [0, 0, 0]
        self.host_evicted = [0, 0, 0]
        self.next_rid = 0
        self.steps = 0

    # ------------------------------------------------------------------ helpers
    def window_start(self, b: int) -> int:
        """First token of the first page touching [max(0, b - W + 1), b) (design.md §3 SWA: a
        query at i reads keys i - W < j <= i); b itself when W = 1 reads nothing before b."""
        return max(0, b - self.W + 1) // self.P * self.P

    def tokens(self, spec, salt):
        """(tokens, salt) of a request from (earlier sequence to reuse or < 0, tokens dropped
        from its end, new tokens) and SALT: mostly a cut of an earlier sequence plus a new
        tail, so paths are shared; from TREE_PICK on, a cut of a cached node's path (every
        other pick a leaf a host-only slot is on, when there is one). A fresh sequence has
        at least one page."""
        idx, drop, new = spec
        if idx >= TREE_PICK and self.tree.num_nodes:
            nodes = self.host_only_leaves() if idx % 2 else []
            nodes = nodes or self.all_nodes()
            x = nodes[idx % len(nodes)]
            base = helpers.node_tokens(x)
            return base[:max(0, len(base) - drop)] + list(new), (self.salt_of(x) if salt == "same" else salt)
        if idx < 0 or not self.history:
            return list(new) + [0] * (self.P - len(new)), (None if salt == "same" else salt)
        base_salt, base = self.history[idx % len(self.history)]
        return base[:max(0, len(base) - drop)] + list(new), (base_salt if salt == "same" else salt)

    def host_only_leaves(self):
        """Leaves with a slot only the host tier holds on their path (a match of a leaf's
        tokens can reach its end: leaves are useful)."""
        out = []
        for x in self.all_nodes():
            if x.children:
                continue
            y = x
            while y.parent is not None:
                if any(v is None and h is not None for v, h in zip(y.value, y.host)):
                    out.append(x)
                    break
                y = y.parent
        return out

    def salt_of(self, x):
        while x.parent is not None:
            x = x.parent
        return self.tree.salt_of(x)

    def remember(self, salt, tokens):
        if tokens and (salt, tokens) not in self.history:
            self.history.append((salt, list(tokens)))
            del self.history[:-24]

    def free(self, handles) -> None:
        """Give what the tree handed back to the allocators, the host tier's (`.host`) to
        the host allocators (DoubleFree = a bug)."""
        for ci, name in enumerate(NAMES):
            h = handles[name]
            if len(h):
                self.allocs[ci].free(array("i", h))
            h = handles.host[name]
            if len(h):
                self.hpools[ci].free(h)

    def make_pin(self, node, rc):
        if node.parent is None:
            return Pin(rc, node, None, None)
        P = self.P
        mamba = node.value[MAMBA] is not None or node.host[MAMBA] is not None
        lo = (0, self.window_start(node.end), mamba)
        snap = tuple((chain_pages(node, FULL, lo[0], P, host), chain_pages(node, SWA, lo[1], P, host),
                      tier_of(node, host)[MAMBA][0] if tier_of(node, host)[MAMBA] is not None else None)
                     for host in (False, True))
        return Pin(rc, node, lo, snap)

    def unlock(self, pin) -> None:
        gone = self.tree.unlock(pin.rc)
        if gone is not None:
            assert isinstance(gone, Freed)
            self.free(gone)
        self.released.append(pin.rc)

    def all_nodes(self, tree=None):
        return helpers.all_nodes(self.tree if tree is None else tree)

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

    def expected_match(self, salt, tokens, host=True):
        """The §3 boundary rule by brute force on per-page presence along the path: with
        `host`, a slot counts when either tier holds it; without, only the device.
        Returns (matched, boundary, deepest, device handles at the boundary, what the
        boundary needs that only the host holds: FULL pages, SWA pages, whether the
        checkpoint)."""
        P = self.P
        path, matched = self.brute_path(self.tree.find_root(salt), tokens)
        dev, hst, ck = ([], []), ([], []), {}
        for x in path:
            npg = (x.end - x.start) // P
            for ci in (FULL, SWA):
                dev[ci].extend(x.value[ci] if x.value[ci] is not None else [None] * npg)
                hst[ci].extend(x.host[ci] if x.host[ci] is not None else [None] * npg)
            if x.end <= matched:
                d, h = x.value[MAMBA], x.host[MAMBA]
                if d is not None or (host and h is not None):
                    ck[x.end] = d[0] if d is not None else None
        npm = matched // P
        pres = [[dev[ci][p] is not None or (host and hst[ci][p] is not None) for p in range(npm)]
                for ci in (FULL, SWA)]

        def full_ok(b):
            return all(pres[FULL][:b // P])

        def swa_ok(b):
            return all(pres[SWA][self.window_start(b) // P: b // P])

        def mamba_ok(b):
            return b == 0 or b in ck

        bs = range(0, matched + 1, P)
        best = max(b for b in bs if full_ok(b) and swa_ok(b) and mamba_ok(b))
        deepest = {"full": max(b for b in bs if full_ok(b)), "swa": max(b for b in bs if swa_ok(b)),
                   "mamba": max(b for b in bs if mamba_ok(b))}
        wpages = range(self.window_start(best) // P, best // P)
        handles = {"full": dev[FULL][:best // P], "swa": [dev[SWA][p] for p in wpages],
                   "mamba": [ck[best]] if best else []}
        missing = ([p for p in range(best // P) if dev[FULL][p] is None],
                   [p for p in wpages if dev[SWA][p] is None],
                   bool(best) and ck[best] is None)
        return matched, best, deepest, handles, missing

    def match(self, tokens, salt, prio, lock=False, host=True):
        """tree.match, checked against the brute-force rule computed before it (this
        driver's, and helpers.brute_force in the same tier mode)."""
        matched, best, deepest, handles, missing = self.expected_match(salt, tokens, host)
        ref = helpers.brute_force(self.tree, tokens, salt, either_tier=host)
        assert (ref.matched, ref.boundary, ref.deepest) == (matched, best, deepest), (ref, best, deepest)
        if not (any(missing[:2]) or missing[2]):
            assert ref.handles == handles, (ref.handles, handles)
        before = (self.tree.num_nodes, self.tree.clock)
        assert self.tree.reusable(tokens, salt, host=host) == best  # the scheduler's question
        assert (self.tree.num_nodes, self.tree.clock) == before, "reusable changed the tree"
        m = self.tree.match(tokens, salt, prio, lock=lock, host=host)
        assert m.matched == matched, f"matched {m.matched}, brute force {matched}"
        assert m.boundary == best, (
            f"boundary {m.boundary} (host={host}), but the deepest boundary every component "
            f"accepts is {best} (matched {matched}, per component {deepest})")
        assert m.deepest == deepest, (host, m.deepest, deepest)
        assert (m.receipt is not None) == lock
        root = self.tree.root(salt)
        assert m.node.end == best
        path = m.node.path()
        x = m.node
        while x.parent is not None:
            assert x.attached
            x = x.parent
        assert x is root, "match ended under another salt's root"
        # what only the host holds (design.md §3 Boundaries: the host-resident part needs a load)
        if any(missing[:2]) or missing[2]:
            assert host
            assert m.handles is None, "loads are pending, yet match handed out handles"
            ws = self.window_start(best)
            exp = {(FULL, y) for y in path if y.value[FULL] is None}
            exp |= {(SWA, y) for y in path if y.end > ws and y.value[SWA] is None}
            if missing[2]:
                exp.add((MAMBA, m.node))
            assert len(m.loads) == len(set(m.loads)), f"a load listed twice: {m.loads}"
            assert set(m.loads) == exp, f"loads {m.loads}, expected {exp}"
            for ci, y in m.loads:
                assert y.value[ci] is None and y.host[ci] is not None, (NAMES[ci], y)
            for ci in range(3):  # root side first, per component
                starts = [y.start for c, y in m.loads if c == ci]
                assert starts == sorted(starts), (NAMES[ci], m.loads)
            P = self.P
            pages = [{p for c, y in m.loads if c == ci for p in range(y.start // P, y.end // P)}
                     for ci in (FULL, SWA)]
            assert pages[FULL] == set(missing[FULL]), (pages[FULL], missing[FULL])
            assert pages[SWA] >= set(missing[SWA]), (pages[SWA], missing[SWA])
            assert m.host_tokens == len(missing[FULL]) * P
            if lock:  # what must be loaded is pinned: no tier may let it go before the load
                for ci, y in m.loads:
                    assert y.locks[ci] > 0, (NAMES[ci], y)
        else:
            assert m.loads == [], f"nothing is host-only, yet loads {m.loads}"
            assert m.handles is not None
            for name in NAMES:
                assert list(m.handles[name]) == handles[name], f"{name} handles at {best}"
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

    def load(self, m, salt, tokens, upto=None) -> bool:
        """Bring what a locked match listed in `loads` to the device (fresh device handles,
        set_device), all of it or the first `upto`; after a whole load, handles_at equals
        the brute force over device data. False when the device has no room (nothing
        loaded then)."""
        loads = m.loads if upto is None else m.loads[:upto]
        counts = {}
        for ci, x in m.loads:
            assert x.attached and x.locks[ci] > 0
            assert x.value[ci] is None and x.host[ci] is not None, (NAMES[ci], x)
        for ci, x in loads:
            counts[ci] = counts.get(ci, 0) + len(x.host[ci])
        got = self.alloc(counts)
        if got is None:
            return False
        for ci, x in loads:
            # the allocation's evictions could not touch the pinned slots
            assert x.attached and x.value[ci] is None and x.host[ci] is not None, (NAMES[ci], x)
            k = len(x.host[ci])
            self.tree.set_device(x, ci, array("i", got[ci][:k]))
            got[ci] = got[ci][k:]
        if len(loads) < len(m.loads):
            return True
        _, best, _, handles, missing = self.expected_match(salt, tokens, host=False)
        assert best == m.boundary, f"after the load, device data serves {best}, the match said {m.boundary}"
        assert not any(missing[:2]) and not missing[2]
        now = self.tree.handles_at(m.node)
        for name in NAMES:
            assert list(now[name]) == handles[name], f"{name} handles after the load"
        return True

    def alloc(self, counts: dict):
        """Allocate like an engine: evict the shortfall first (write-back when set up so);
        None when locked data leaves too little (nothing allocated then)."""
        for ci, k in counts.items():
            short = k - self.allocs[ci].available
            if short > 0:
                self.evict(ci, short, answers=self.write_back)
        if any(self.allocs[ci].available < k for ci, k in counts.items()):
            return None
        return {ci: list(self.allocs[ci].alloc(k)) for ci, k in counts.items()}

    def host_room(self, counts: dict) -> None:
        """Evict the host tier's shortfall before copying slots there."""
        for ci, k in counts.items():
            short = k - self.hpools[ci].available
            if short > 0:
                self.evict(ci, short, host=True)

    def rank(self, x, ci):
        """design.md §3: (has session references, number of references, base policy),
        spare slots (unreferenced) before all others."""
        p = self.policy
        bk = (x.tick if p == "lru" else x.created if p == "fifo"
              else (x.hits, x.tick) if p == "lfu" else (x.priority, x.tick))
        if x.refs[ci]:
            return (1, x.refs[ci], bk)
        return (-1, 0, bk) if x.spare >> ci & 1 else (0, 0, bk)

    def backup_fn(self, answers):
        """A device eviction's write-back callback, answering in turn: True, host handles
        for the slot when the host pool has room; "room", the same after evicting the
        host tier's shortfall (re-entering the tree from inside its eviction, as an
        engine's write-back may); False, decline (None). Records what it was asked
        (`calls`) and what the evictions it made freed (`nested`)."""
        it = cycle(answers)
        calls, nested = [], []

        def backup(nd, ci):
            assert nd.attached and nd.value[ci] is not None and nd.host[ci] is None, (NAMES[ci], nd)
            assert not nd.locks[ci], f"asked to back up a locked {NAMES[ci]} slot of {nd}"
            k = len(nd.value[ci])
            a = next(it)
            if a == "room" and self.hpools[ci].available < k:
                nested.append(self.evict(ci, k - self.hpools[ci].available, host=True))
            if not a or self.hpools[ci].available < k:
                calls.append((nd, ci, None))
                return None
            h = self.hpools[ci].alloc(k)
            calls.append((nd, ci, h))
            return h

        backup.calls, backup.nested, backup.writes = calls, nested, []
        backup.always = all(answers)
        return backup

    def writer_fn(self):
        """A host eviction's write-back hook (to the tier below): called before a slot
        only the host holds is lost; what it returns is unused (a bogus handle here, so a
        tree that kept it would show)."""
        writes = []

        def write(nd, ci):
            assert nd.attached and nd.value[ci] is None and nd.host[ci] is not None, (NAMES[ci], nd)
            assert not nd.locks[ci], f"asked to write out a locked {NAMES[ci]} slot of {nd}"
            writes.append((nd, ci, list(nd.host[ci])))
            return array("i", [-7])

        write.calls, write.nested, write.writes, write.always = [], [], writes, False
        return write

    def evict(self, ci: int, k: int, host: bool = False, answers=None):
        want = [0, 0, 0]
        want[ci] = k
        return self.evict_want(want, host, answers)

    def evict_want(self, want, host=False, answers=None):
        """Evict one tier; with `answers`, through evict_counts with a write-back hook
        (device: backup_fn, host: writer_fn)."""
        backup = None if answers is None else self.writer_fn() if host else self.backup_fn(answers)
        freed = self.checked_evict(self.tree, want, host, backup)
        self.free(freed)
        for c, name in enumerate(NAMES):
            self.evicted[c] += len(freed[name])
            self.host_evicted[c] += len(freed.host[name])
        return freed

    def checked_evict(self, tree, want, host=False, backup=None):
        """Evict one tier (tree.evict / evict_host, or evict_counts with a write-back
        callback), checking that a one-component eviction starts with a best-ranked slot
        that can go, that it stops short only when no such slot is left, and that
        `offloaded` counts device slots that left while a host copy stays."""
        nodes = self.all_nodes(tree)

        def sure(x, ci):
            """Slot (x, ci) of the evicted tier can go now whatever a write-back says:
            unlocked, and FULL on a leaf or with a copy in the other tier."""
            if tier_of(x, host)[ci] is None or x.locks[ci]:
                return False
            return ci != FULL or not x.children or tier_of(x, not host)[FULL] is not None

        def maybe(x):
            """Device FULL of an internal node without a host copy whose children hold no
            device FULL: it goes only when the write-back gives it a host copy."""
            return (not host and x.value[FULL] is not None and not x.locks[FULL] and x.children
                    and x.host[FULL] is None and all(c.value[FULL] is None for c in x.children.values()))

        single = [ci for ci in range(3) if want[ci]]
        ci = single[0] if len(single) == 1 else None
        if ci is not None:
            cands = [x for x in nodes if sure(x, ci)]
            maybes = [x for x in nodes if ci == FULL and maybe(x)]
            before = {x: list(tier_of(x, host)[ci]) for x in cands + maybes}
            ranks = {x: self.rank(x, ci) for x in cands + maybes}
        slots = [(x, c, list(x.value[c]), x.host[c] is not None) for x in nodes for c in range(3)
                 if x.value[c] is not None]
        # the other tier's handles, by owner: evicting one tier frees the other's data only
        # with a node that goes whole (a slot lost in every tier is one the evicted tier
        # held alone)
        other = {(c, h): x for x in nodes for c in range(3) if tier_of(x, not host)[c] is not None
                 for h in tier_of(x, not host)[c]}
        off0 = list(tree.offloaded)
        if backup is None:
            kw = {EVICT_KW[c]: k for c, k in enumerate(want) if k}
            ev = tree.evict_host(**kw) if host else tree.evict(**kw)
            freed = ev.freed
        else:
            freed = helpers.evict_with(tree, list(want), backup, host)
        assert isinstance(freed, Freed)
        side = freed.host if host else freed
        if not any(want):
            assert not any(len(freed[n]) or len(freed.host[n]) for n in NAMES), "evict(0) freed something"
            return freed
        for x, c, hs in (backup.writes if backup else ()):  # written out, then lost
            assert set(hs) <= set(freed.host[NAMES[c]]), (
                f"{NAMES[c]} slot of {x} was written out as it was lost, yet its host handles stay")
        oside = freed if host else freed.host
        for x, c, h in (backup.calls if backup else ()):  # copies made during this eviction
            for hh in h if h is not None else ():
                other[(c, hh)] = x
        for c, name in enumerate(NAMES):
            for h in oside[name]:
                x = other.get((c, h))
                assert x is not None and not x.attached, (
                    f"evicting the {'host' if host else 'device'} tier freed {name} handle {h} of the "
                    f"other tier on {x}, which stays")
        # offloaded: device slots that left while the host keeps (or got) a copy
        took = {(c, id(x)) for x, c, h in (backup.calls if backup else ()) if h is not None}
        for c in range(3):
            gone = set(freed[NAMES[c]])
            lo = hi = 0
            for x, cc, v, had in slots:
                if cc != c or not set(v) <= gone:
                    continue
                if x.attached and x.host[c] is not None:
                    lo += len(v)
                if had or (c, id(x)) in took:
                    hi += len(v)
            d = tree.offloaded[c] - off0[c]
            if host:
                assert d == 0, f"host eviction counted {d} {NAMES[c]} handles as offloaded"
            else:
                assert lo <= d <= hi, f"{NAMES[c]}: offloaded {d}, expected within [{lo}, {hi}]"
        if ci is None:
            return freed
        k = want[ci]
        got = side[NAMES[ci]]
        free_ok = cands + [x for x in maybes if (ci, id(x)) in took]
        if free_ok:
            best = min(ranks[x] for x in free_ok)
            first = [x for x in free_ok if ranks[x] == best]
            gone = set(got)
            for f in (backup.nested if backup else ()):  # a write-back made room meanwhile
                gone.update(f[NAMES[ci]])
            if not any(set(before[x]) <= gone for x in first):
                went = {x: ranks[x] for x in free_ok if set(before[x]) <= gone}
                raise AssertionError(
                    f"{self.policy}: evict{'_host' if host else ''}({EVICT_KW[ci]}={k}) passed over "
                    f"the best-ranked slot(s) {first} (rank (has refs or -1 spare, refs, base key) = {best}); "
                    f"it took {went}")
        if len(got) < k:
            left = [x for x in self.all_nodes(tree) if sure(x, ci)]
            if STRICT_WRITE_BACK and ci == FULL and backup is not None and backup.always:
                # a write-back that always agrees (and finds room) takes every unlocked
                # device FULL slot, internal ones included, also those an earlier eviction
                # passed over (test_host_tier.py::
                # test_write_back_offers_an_internal_full_slot_a_plain_eviction_skipped)
                late = [x for x in self.all_nodes(tree) if maybe(x)]
                if sum(len(x.value[FULL]) for x in late) <= self.hpools[FULL].available:
                    left += late
            assert not left, (f"evict{'_host' if host else ''}({EVICT_KW[ci]}={k}) freed only "
                              f"{len(got)} while slots that can go remain: {left}")
        return freed

    # ------------------------------------------------------------------ requests
    def page_ends(self, lo: int, hi: int, picks) -> list[int]:
        """Checkpoint positions: page ends in [lo, hi] picked by offset (in pages)."""
        ends = list(range(lo, hi + 1, self.P))
        return sorted({ends[i] for i in picks if i < len(ends)})

    def begin(self, tokens, salt, prio, ck, jck, how="device"):
        """Match, lock what is reused (`how`: device data alone; or "load": host copies
        too, loaded to the device under the match's lock), allocate own pages, a state
        slot and checkpoint slots (at page ends from the boundary on; with jck also at
        the junction)."""
        P = self.P
        if how == "load":
            m = self.match(tokens, salt, prio, lock=True)
            pin = self.make_pin(m.node, m.receipt)
            if m.loads:
                if not self.load(m, salt, tokens):
                    self.unlock(pin)
                    return None
                handles = self.tree.handles_at(m.node)
            else:
                handles = m.handles
        else:
            m = self.match(tokens, salt, prio, host=False)
            pin = self.make_pin(m.node, self.tree.lock(m.node))
            handles = m.handles
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
        r.tree_full = list(handles["full"])
        swa_h = list(handles["swa"])
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
        path, pre = self.brute_path(self.tree.find_root(r.salt), r.tokens)
        ws = self.window_start(n)
        tree_swa = present_pages(path[-1], SWA, ws, P) if path else set()
        # the request brings everything a later request needs to resume at its end: the
        # checkpoint at n and the SWA window before n (its own pages, the tree's below b,
        # in either tier)
        resumable = (not running and n > 0 and n in ck and pre == r.b
                     and all(p in tree_swa for p in range(ws // P, bp))
                     and all(p in passed_swa for p in range(max(ws // P, bp), npg)))
        res = self.tree.insert(r.tokens, {"full": array("i", full_in), "swa": array("i", swa_in),
                                          "mamba": ck},
                               prefix_len=r.b, resume_points=j, salt=r.salt, priority=r.prio, lock=running)
        assert isinstance(res.free, Freed)
        self.free(res.free)
        assert res.existing == pre and res.existing >= r.b, (res.existing, pre, r.b)
        if not self.keep_all:
            # design.md §3 Retention: of this insert's SWA pages the tree keeps only those in
            # the window at the end (a finished request's) and the window at the junction;
            # with spares, it keeps the rest too, as spares
            spans = [(self.window_start(n), n)] if not (running and self.keep_spare) else []
            if j:
                jj = min(j, n) // P * P
                spans.append((self.window_start(jj), jj))
            holder = {h: x for x in self.all_nodes() if x.value[SWA] is not None for h in x.value[SWA]}
            for p, h in passed_swa.items():
                x = holder.get(h)
                if x is None:
                    continue
                inside = any(lo <= p * P and (p + 1) * P <= hi for lo, hi in spans)
                if not self.keep_spare:
                    assert inside, f"SWA page {p} kept outside the retention windows {spans}"
                elif p * P >= pre:  # a new node: spare exactly where no retention window is
                    assert bool(x.spare >> SWA & 1) != inside, (
                        f"SWA page {p} on {x!r}: spare={x.spare >> SWA & 1}, retention windows {spans}")
        if resumable:
            # design.md §3 Retention: the window at the end of a cached sequence is kept
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
            assert -1 not in r.tree_full, (
                f"a running request goes on from the tree's copy, but FULL pages "
                f"{[i for i, h in enumerate(r.tree_full) if h < 0]} are not on the device")
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
        if self.write_through is not None and res.node.attached:
            self.back_up(res.node, self.write_through)

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
          jmode=JMODE, junction=st.integers(0, 32), end_ckpt=END_CKPT, sid=SID, how=BEGIN)
    def serve_request(self, tokens, salt, prio, ck, jck, decode, jmode, junction, end_ckpt, sid, how):
        """A whole request in one step: start, decode a little, finish."""
        r = self.begin(*self.tokens(tokens, salt), prio, ck, jck, how)
        if r is None:
            return
        for add, more in decode:
            self.extend(r, add, more)
            self.release_swa(r, "engine")
        self.insert(r, False, jmode, junction, end_ckpt, sid)

    @precondition(lambda self: len(self.reqs) < MAX_REQS)
    @rule(tokens=TOKENS, salt=SALT, prio=PRIORITY, ck=PAGE_PICKS, jck=st.booleans(), how=BEGIN)
    def start_request(self, tokens, salt, prio, ck, jck, how):
        self.begin(*self.tokens(tokens, salt), prio, ck, jck, how)

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
    @rule(tokens=TOKENS, salt=SALT, prio=PRIORITY,
          lock=st.sampled_from(["no", "lock", "match_lock", "load"]), host=st.booleans(),
          upto=st.one_of(st.none(), st.integers(0, 3)))
    def match_tokens(self, tokens, salt, prio, lock, host, upto):
        """A match under any salt (salt isolation is checked inside), over both tiers or
        the device alone; then maybe a lock, taken apart (lock(node)) or with the match
        (match(lock=True)); or a load: match with lock, the host-only slots it lists get
        device copies (all of them, or the first `upto`)."""
        toks, salt = self.tokens(tokens, salt)
        if lock == "no" or len(self.held) >= MAX_HELD:
            self.match(toks, salt, prio, host=host)
        elif lock == "lock":
            m = self.match(toks, salt, prio, host=host)
            self.held.append(self.make_pin(m.node, self.tree.lock(m.node)))
        elif lock == "match_lock":
            m = self.match(toks, salt, prio, lock=True, host=host)
            assert m.receipt is not None and m.receipt.node is m.node
            self.held.append(self.make_pin(m.node, m.receipt))
        else:
            m = self.match(toks, salt, prio, lock=True)
            pin = self.make_pin(m.node, m.receipt)
            if m.loads:
                self.load(m, salt, toks, upto)
            if upto is None:
                self.held.append(pin)
            else:
                self.unlock(pin)

    @precondition(lambda self: self.tree.hosted)
    @rule(pick=PICK, extra=st.lists(TOKEN, max_size=4), prio=PRIORITY,
          upto=st.one_of(st.none(), st.none(), st.integers(0, 3)), keep=st.booleans())
    def load_cached(self, pick, extra, prio, upto, keep):
        """Load a cached path a host-only slot is on (to a leaf): match it (same salt) with lock, load
        what the match lists (all, or the first `upto`), keep the lock or release it."""
        nodes = self.host_only_leaves()
        if not nodes:
            return
        x = nodes[pick % len(nodes)]
        toks, salt = helpers.node_tokens(x) + list(extra), self.salt_of(x)
        m = self.match(toks, salt, prio, lock=True)
        pin = self.make_pin(m.node, m.receipt)
        if m.loads:
            self.load(m, salt, toks, upto)
        if keep and upto is None and len(self.held) < MAX_HELD:
            self.held.append(pin)
        else:
            self.unlock(pin)

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
    @rule(ci=st.sampled_from([FULL, SWA, MAMBA]), k=EVICT_K,
          answers=st.one_of(st.none(), ANSWERS))
    def evict_some(self, ci, k, answers):
        """Device eviction: plain, or with a write-back callback that backs slots up as
        they leave (or declines)."""
        self.evict(ci, k, answers=answers)

    @precondition(lambda self: self.tree.num_nodes)
    @rule(answers=ANSWERS, order=st.permutations([FULL, SWA, MAMBA]))
    def offload_all(self, answers, order):
        """Everything unlocked leaves the device, backed up on the way where the host
        has room and the write-back agrees: the next requests must load."""
        for ci in order:
            self.evict(ci, HUGE, answers=answers)

    @precondition(lambda self: self.tree.num_nodes)
    @rule(ci=st.sampled_from([FULL, SWA, MAMBA]), k=EVICT_K, write=st.booleans())
    def evict_host_some(self, ci, k, write):
        """Host eviction: plain, or with the hook that writes what is lost to the tier below."""
        self.evict(ci, k, host=True, answers=[True] if write else None)

    @precondition(lambda self: self.tree.num_nodes)
    @rule(want=st.tuples(EVICT_FEW, EVICT_FEW, EVICT_FEW), host=st.booleans(),
          answers=st.one_of(st.none(), ANSWERS))
    def evict_several(self, want, host, answers):
        """Several components in one call, either tier."""
        self.evict_want(list(want), host, answers)

    # ------------------------------------------------------------------ host tier
    def host_copies(self, chosen):
        """Give the chosen device slots host copies (evicting the host's shortfall first);
        slots that no longer qualify after that eviction, or find no room, are skipped."""
        need = {}
        for ci, x in chosen:
            need[ci] = need.get(ci, 0) + len(x.value[ci])
        self.host_room(need)
        for ci, x in chosen:
            if not x.attached or x.value[ci] is None or x.host[ci] is not None:
                continue
            k = len(x.value[ci])
            if self.hpools[ci].available >= k:
                self.tree.set_host(x, ci, self.hpools[ci].alloc(k))

    @precondition(lambda self: self.tree.num_nodes)
    @rule(picks=st.lists(PICK, min_size=1, max_size=6, unique=True))
    def back_up_slots(self, picks):
        """Write-through of random device slots."""
        cands = [(ci, x) for x in self.all_nodes() for ci in range(3)
                 if x.value[ci] is not None and x.host[ci] is None]
        if cands:
            self.host_copies([cands[i % len(cands)] for i in sorted({i % len(cands) for i in picks})])

    @rule(pick=PICK, min_hits=st.sampled_from([0, 0, 1, 2, 3]))
    def back_up_path(self, pick, min_hits):
        """Write-through of a path: what unbacked() lists (checked against the nodes)."""
        nodes = self.all_nodes()
        self.back_up(nodes[pick % len(nodes)] if nodes else self.tree.root(None), min_hits)

    def back_up(self, x, min_hits):
        """Give the unbacked device slots on x's path (nodes hit at least min_hits times)
        host copies, as far as the host has room; unbacked() is held against the nodes
        before and after."""
        def unbacked():
            got = self.tree.unbacked(x, min_hits)
            exp = [(ci, y) for y in x.path() if y.hits >= min_hits for ci in range(3)
                   if y.value[ci] is not None and y.host[ci] is None and not y.spare >> ci & 1]
            assert got == exp, f"unbacked({x}, {min_hits}) = {got}, the path says {exp}"
            return got

        chosen = unbacked()
        if not chosen:
            return
        self.host_copies(chosen)
        if x.attached:
            unbacked()

    @precondition(lambda self: self.tree.num_nodes)
    @rule(picks=st.lists(PICK, min_size=1, max_size=4, unique=True))
    def load_slots(self, picks):
        """Prefetch random host-only slots to the device (set_device, outside a match)."""
        cands = [(ci, x) for x in self.all_nodes() for ci in range(3)
                 if x.value[ci] is None and x.host[ci] is not None]
        if not cands:
            return
        chosen = [cands[i % len(cands)] for i in sorted({i % len(cands) for i in picks})]
        counts = {}
        sizes = [len(x.host[ci]) for ci, x in chosen]
        for (ci, x), k in zip(chosen, sizes):
            counts[ci] = counts.get(ci, 0) + k
        got = self.alloc(counts)
        if got is None:
            return
        for (ci, x), k in zip(chosen, sizes):
            h, got[ci] = got[ci][:k], got[ci][k:]
            if x.attached and x.value[ci] is None and x.host[ci] is not None:
                self.tree.set_device(x, ci, array("i", h))
            else:  # the allocation's eviction took it
                self.allocs[ci].free(array("i", h))

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
    def check_draft_index(self):
        """The index finds every run of 2 tokens that ends in a node's span under its
        tenant's root, only at real places (the run ends right before the position it
        gives, in a node of that tree), and no run that has left the tree; it holds those
        runs and no other, names no removed node, and counts the tree's tokens."""
        if self.tree is None:
            return
        ix = self.tree.drafts
        want = set()
        for root in self.tree.roots.values():
            for nd in self.tree.nodes():
                if nd.path()[0].parent is not root:
                    continue
                toks = helpers.node_tokens(nd)
                for j in range(max(1, nd.start), nd.end):
                    want.add((id(root), bytes(array("I", toks[j - 1:j + 1]))))
        roots = {id(r): r for r in self.tree.roots.values()}
        for rid, run in want:
            found = ix.occurrences(roots[rid], run)
            assert found, (rid, run)
            for x, at in found:
                assert x.attached and x.path()[0].parent is roots[rid]
                toks = helpers.node_tokens(x)
                assert x.start < x.start + at <= x.end
                assert bytes(array("I", toks[x.start + at - 2:x.start + at])) == run
        self.runs_seen |= want
        for rid, run in self.runs_seen - want:
            assert ix.occurrences(roots[rid], run) == []
        assert {(rid, run) for rid, d in ix.runs.items() for run in d} == want
        assert all(x.attached for d in ix.runs.values() for v in d.values() for x in (v if type(v) is list else (v,)))

    @invariant()
    def check_everything(self):
        if self.tree is None:
            return
        t, P, W = self.tree, self.P, self.W
        nodes = []
        held = (([], [], []), ([], [], []))  # per tier (device, host), per component
        for root in t.roots.values():
            assert root.value == [None] * 3 and root.host == [None] * 3
            assert root.locks == [0] * 3 and root.refs == [0] * 3
            stack = [root]
            while stack:
                x = stack.pop()
                for k, c in x.children.items():
                    assert c.parent is x and c.attached, c
                    assert c.start == x.end < c.end and c.start % P == 0 and c.end % P == 0, c
                    assert len(c.key) == 4 * (c.end - c.start) and k == c.key[:4 * P], c
                    npg = (c.end - c.start) // P
                    # FULL shapes the tree: every attached node holds it in some tier
                    assert c.value[FULL] is not None or c.host[FULL] is not None, f"FULL in no tier on {c}"
                    for tier, h in ((c.value, held[0]), (c.host, held[1])):
                        assert tier[FULL] is None or len(tier[FULL]) == npg, c
                        assert tier[SWA] is None or len(tier[SWA]) == npg, c
                        assert tier[MAMBA] is None or len(tier[MAMBA]) == 1, c
                        for ci in range(3):
                            if tier[ci] is not None:
                                h[ci].extend(tier[ci])
                    assert min(c.locks) >= 0, f"negative lock count on {c}"
                    assert min(c.refs) >= 0, f"negative session count on {c}: {c.refs}"
                    nodes.append(c)
                    stack.append(c)
        assert t.num_nodes == len(nodes)

        # exact accounting, per tier: free list, a running request (device only), or the
        # tree in that tier; once each
        own = self.owned()
        for ci, name in enumerate(NAMES):
            for tier, alloc, mine in (("device", self.allocs[ci], own[ci]), ("host", self.hpools[ci], ())):
                h = held[tier == "host"][ci]
                alloc.check()
                cnt = Counter(h)
                cnt.update(mine)
                twice = sorted(x for x, c in cnt.items() if c > 1)
                assert not twice, f"{name} {tier}: handles owned twice (tree/request): {twice}"
                allocated = set(alloc.allocated())
                leaked = sorted(allocated - set(cnt))
                assert not leaked, f"{name} {tier}: allocated but owned by nobody (leak): {leaked}"
                stray = sorted(set(cnt) - allocated)
                assert not stray, f"{name} {tier}: held by tree/request but free in the allocator: {stray}"
            assert t.size[ci] == len(held[0][ci]), f"{name}: tree.size {t.size[ci]} != {len(held[0][ci])}"
            assert t.host_size[ci] == len(held[1][ci]), (
                f"{name}: tree.host_size {t.host_size[ci]} != {len(held[1][ci])}")
            locked = sum(len(x.value[ci]) for x in nodes if x.locks[ci] and x.value[ci] is not None)
            assert t.locked[ci] == locked, f"{name}: tree.locked {t.locked[ci]} != {locked}"
            locked = sum(len(x.host[ci]) for x in nodes if x.locks[ci] and x.host[ci] is not None)
            assert t.host_locked[ci] == locked, f"{name}: tree.host_locked {t.host_locked[ci]} != {locked}"
            assert t.evicted[ci] == self.evicted[ci], f"{name}: tree.evicted {t.evicted[ci]} != {self.evicted[ci]}"
            assert t.host_evicted[ci] == self.host_evicted[ci], (
                f"{name}: tree.host_evicted {t.host_evicted[ci]} != {self.host_evicted[ci]}")
            assert 0 <= t.offloaded[ci] <= t.evicted[ci], (name, t.offloaded[ci], t.evicted[ci])

        # lock counts and session references are exactly what the live receipts pinned
        exp_l = self.expected_counts(self.lock_pins())
        exp_r = self.expected_counts(self.sessions.values())
        for x in nodes:
            assert x.locks == exp_l.get(x, [0, 0, 0]), (
                f"lock counts {x.locks} on {x}, receipts pinned {exp_l.get(x, [0, 0, 0])}")
            assert x.refs == exp_r.get(x, [0, 0, 0]), (
                f"session refs {x.refs} on {x}, sessions pinned {exp_r.get(x, [0, 0, 0])}")

        # locked data was never evicted, in either tier
        check_pinned(self.lock_pins(), P)

        # no useless leaf survives unlocked (presence in either tier counts)
        for x in nodes:
            if x.children or x.locks[FULL]:
                continue
            swa = present_pages(x, SWA, self.window_start(x.end), P)
            need = range(self.window_start(x.end) // P, x.end // P)
            assert all(p in swa for p in need), f"unlocked leaf {x} lacks its SWA window (W={W})"
            assert x.value[MAMBA] is not None or x.host[MAMBA] is not None, (
                f"unlocked leaf {x} has no checkpoint at its end")

        if self.steps % 4 == 0:  # the same by the shared brute force, now and then
            helpers.check_useful_leaves(t)

        # every evictable slot is on its component's eviction list of its tier, in the
        # queue its session references and spare bit say (Node.where: 1 unreferenced, 2
        # referenced, 3 spare);
        # FULL of an internal node is evictable where the other tier holds a copy
        for x in nodes:
            for ci in range(3):
                for host in (False, True):
                    if tier_of(x, host)[ci] is None or x.locks[ci]:
                        continue
                    if ci == FULL and x.children and tier_of(x, not host)[FULL] is None:
                        continue
                    q = 2 if x.refs[ci] else 3 if x.spare >> ci & 1 else 1
                    w = x.where[3 * host + ci]
                    assert w == q, (
                        f"evictable {'host' if host else 'device'} {NAMES[ci]} slot of {x} "
                        f"(refs {x.refs[ci]}) is in eviction queue {w}, expected {q}")

        # the eviction order, one slot at a time, on a copy of the tree (one component and
        # tier per step, in turn, when it has a choice to make)
        ci, host = self.steps % 3, self.steps % 6 >= 3
        self.steps += 1
        if sum(tier_of(x, host)[ci] is not None and x.locks[ci] == 0 for x in nodes) > 1:
            probe, pins = copy.deepcopy((t, self.lock_pins()))
            want = [0, 0, 0]
            want[ci] = 1
            for _ in range(PROBE_POPS):
                got = self.checked_evict(probe, want, host)
                if not len((got.host if host else got)[NAMES[ci]]):
                    break
            check_pinned(pins, P)

        # each request covers its tokens with pages
        for r in self.reqs:
            assert r.b // P + len(r.own_full) == -(-len(r.tokens) // P) == r.b // P + len(r.own_swa)

    def teardown(self):
        """Release everything, evict everything (device, then host): the tree must end
        empty and every allocator, device and host, full (skipped when a step already
        failed)."""
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
        t = self.tree
        for ci in (SWA, MAMBA, FULL):
            self.evict(ci, HUGE)
        assert t.size == [0, 0, 0] or t.hosted, f"device eviction of everything left {t.size}"
        for ci in (SWA, MAMBA, FULL):
            self.evict(ci, HUGE, host=True)
        assert t.num_nodes == 0 and not any(r.children for r in t.roots.values()), (
            f"evicting everything unlocked (device, then host) left {t.num_nodes} nodes: {self.all_nodes()}")
        assert t.size == [0, 0, 0] and t.locked == [0, 0, 0], f"size {t.size}, locked {t.locked}"
        assert t.host_size == [0, 0, 0] and t.host_locked == [0, 0, 0], (t.host_size, t.host_locked)
        for a in self.allocs + self.hpools:
            assert a.used == 0, f"{a.name}: {a.used} handles never came back"


_ALL_CHECKS = list(HealthCheck)

TestRadixTreeStateful = RadixTreeMachine.TestCase
TestRadixTreeStateful.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=_ALL_CHECKS)


@pytest.mark.slow
class TestRadixTreeStatefulSlow(RadixTreeMachine.TestCase):
    settings = settings(max_examples=2000, stateful_step_count=120, deadline=None,
                        suppress_health_check=_ALL_CHECKS)
