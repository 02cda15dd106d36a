"""`RadixTree.match` against a brute-force reading of the boundary rule (design.md §3).

For every page-aligned b in [0, matched] the reference checks each component's rule
directly on per-page presence read from the nodes along the query's path:

- FULL (and any window-less page component): present on every page of [0, b);
- SWA (window W): present on every page touching [max(0, b - W + 1), b) (a query at
  i reads keys i - W < j <= i);
- MAMBA: a checkpoint at exactly b;

and `matched` is the longest page-aligned common prefix with any root-to-leaf key
sequence. Trees are random: page sizes, windows, retention (keep_all or the default
windows at the end and the junction), SWA holes, checkpoints (at the junction too),
per-component evictions that leave tombstones, locks, and queries that are prefixes,
extensions and branches of inserted sequences, aligned or not.
"""
from __future__ import annotations

import random
from array import array

import pytest

from uniradix.tree import POLICIES, CheckpointComponent, FullComponent, MambaComponent, RadixTree, SWAComponent


import helpers as H  # tests/tree is on sys.path: pytest prepends a test file's folder


# --------------------------------------------------------------------------- random trees
class Sim:
    """One random tree and the sequences put into it; `P` and `W` fix the page size and
    the SWA window (the tree then always has SWA)."""

    def __init__(self, rng: random.Random, P: int | None = None, W: int | None = None):
        self.rng = rng
        P = self.P = rng.choice([1, 2, 4, 8]) if P is None else P
        comps = [FullComponent()]
        kinds = rng.choice(["full", "swa", "mamba", "swa+mamba", "swa+mamba", "swa+mamba",
                            "all", "swa+swa2", "mamba+wpx"] if W is None else
                           ["swa", "swa+mamba", "swa+mamba", "all", "swa+swa2"])
        if "swa" in kinds or kinds == "all":
            if W is None:
                W = rng.choice([1, P, 2 * P, 3 * P, rng.randint(1, 4 * P)])
            keep = rng.choice(["windows", "all", "spare"])
            comps.append(SWAComponent(W, keep_all=keep == "all", keep_spare=keep == "spare"))
        if "swa2" in kinds or kinds == "all":
            W2 = rng.choice([P, 2 * P, rng.randint(1, 3 * P)])
            keep = rng.choice(["windows", "all", "spare"])
            comps.append(H.SecondSWAComponent(W2, keep_all=keep == "all", keep_spare=keep == "spare"))
        if "mamba" in kinds or kinds == "all":
            comps.append(MambaComponent())
        if "wpx" in kinds or kinds == "all":
            comps.append(H.WholePrefixComponent())
        tail = comps[1:]
        rng.shuffle(tail)
        self.tree = RadixTree([comps[0]] + tail, page_size=P, eviction_policy=rng.choice(POLICIES))
        self.alphabet = rng.choice([2, 3, 5])
        self.maxpages = rng.choice([4, 6, 10])
        self.seqs: list[list[int]] = []
        self.receipts = []
        self.hole_p = rng.choice([0.0, 0.1, 0.3])
        self.ckpt_p = rng.choice([0.2, 0.5, 0.9])
        self.ledger = H.Ledger(self.tree)

    # ---------------------------------------------------------------- sequences
    def tokens(self, k: int) -> list[int]:
        a = self.alphabet
        return [self.rng.randrange(a) for _ in range(k)]

    def new_seq(self) -> list[int]:
        rng, P = self.rng, self.P
        n = rng.randint(1, self.maxpages) * P + (rng.randrange(P) if rng.random() < 0.3 else 0)
        if self.seqs and rng.random() < 0.8:
            base = rng.choice(self.seqs)
            cut = rng.randint(0, len(base))
            if rng.random() < 0.5:
                cut -= cut % P
            seq = base[:cut] + self.tokens(max(0, n - cut))
            if rng.random() < 0.3 and cut < min(len(seq), len(base)):  # diverge right at cut
                seq[cut] = (base[cut] + 1) % self.alphabet
            return seq
        return self.tokens(n)

    def query(self) -> list[int]:
        rng, P = self.rng, self.P
        if not self.seqs or rng.random() < 0.1:
            return self.tokens(rng.randint(0, self.maxpages * P))
        base = rng.choice(self.seqs)
        kind = rng.randrange(4)
        if kind == 0:       # exact
            return list(base)
        if kind == 1:       # prefix, aligned or not
            cut = rng.randint(0, len(base))
            if rng.random() < 0.5:
                cut -= cut % P
            return base[:cut]
        if kind == 2:       # extension
            return base + self.tokens(rng.randint(1, 3 * P))
        cut = rng.randint(0, len(base))  # branch
        out = base[:cut] + self.tokens(rng.randint(1, 3 * P))
        if cut < len(base):
            out[cut] = (base[cut] + 1) % self.alphabet
        return out

    # ---------------------------------------------------------------- operations
    def insert(self) -> None:
        rng, P, tree, led = self.rng, self.P, self.tree, self.ledger
        seq = self.new_seq()
        n = len(seq) - len(seq) % P
        npages = n // P
        prefix_len, reused = 0, array("i")
        if rng.random() < 0.3:
            # the realistic flow: match, reuse up to the boundary, hand over the rest
            m = tree.match(seq)
            prefix_len, reused = m.boundary, m.handles["full"]
        # junction: where the request left the cached path (or anywhere)
        junction = None
        r = rng.random()
        if r < 0.4:
            junction = H.brute_matched(tree, seq)[0]
        elif r < 0.6:
            junction = rng.randint(0, n)
        below = prefix_len // P
        values = {}
        for c in tree.components:
            name = c.name
            if isinstance(c, CheckpointComponent):
                cks = {q * P for q in range(1, npages + 1) if rng.random() < self.ckpt_p / 2}
                if n and rng.random() < self.ckpt_p:
                    cks.add(n)  # end of the request
                if junction and rng.random() < 0.6:
                    cks.add(page_floor(min(junction, n), P))  # at the junction
                values[name] = {p: led.slot(name) for p in sorted(cks) if 0 < p <= n}
            elif name == "full":
                values[name] = reused + led.page_values(name, npages - below)
            else:
                if rng.random() < 0.1:
                    continue  # this request brings no data for the component
                absent = {q for q in range(npages - below) if rng.random() < self.hole_p}
                values[name] = array("i", [-1] * below) + led.page_values(name, npages - below, absent)
        lock = rng.random() < 0.25
        res = tree.insert(seq, values, prefix_len=prefix_len, resume_points=junction, lock=lock)
        led.returned(res.free)
        self.check_retention(seq[:n], res.existing, junction, values, lock)
        if res.receipt is not None:
            self.receipts.append((res.receipt, self._had(res.receipt.node)))
        self.seqs.append(seq)

    def check_retention(self, seq, existing: int, junction, values, running: bool = False) -> None:
        """design.md §3 Retention, on the pages this insert added past the cached path: a
        windowed component without keep_all keeps exactly its present pages that touch
        the window before the end (a finished request's) or before the junction (by the
        reference rule); with keep_spare it keeps every present page, the others as
        spares."""
        tree, P, n = self.tree, self.P, len(seq)
        matched, pages, _ = H.per_page(tree, seq)
        if matched < n:
            return  # the new leaf served nothing and went
        for c in tree.components:
            if getattr(c, "window", None) is None or c.keep_all or c.name not in values:
                continue
            ends = set() if running and c.keep_spare else {n}
            if junction:
                ends.add(page_floor(min(junction, n), P))
            want = {q for j in ends for q in H.page_rule_pages(c.window, j, P)}
            leaf = H.brute_matched(tree, seq)[1]
            holder = {q: nd for nd in (leaf.path() if leaf is not None else ())
                      for q in range(nd.start // P, nd.end // P)}
            for q in range(existing // P, n // P):
                h = values[c.name][q]
                kept = h >= 0 and (q in want or c.keep_spare)
                assert pages[c.name][q] == (h if kept else None), (
                    f"{c.name} (W={c.window}, P={P}) page {q}: holds {pages[c.name][q]}, brought {h}, "
                    f"windows before {sorted(ends)} need pages {sorted(want)}")
                if kept and c.keep_spare:
                    assert bool(holder[q].spare >> c.index & 1) == (q not in want), (
                        f"{c.name} (W={c.window}, P={P}) page {q} on {holder[q]!r}: spare "
                        f"{holder[q].spare >> c.index & 1}, windows before {sorted(ends)} need pages {sorted(want)}")

    def evict(self) -> None:
        rng, tree = self.rng, self.tree
        c = rng.choice(tree.components)
        k = rng.choice([1, 1, 2, 3, 8])
        ev = tree.evict(**{c.evict_kw: k})
        self.ledger.returned(ev.freed)

    def lock(self) -> None:
        nodes = H.all_nodes(self.tree)
        if nodes:
            nd = self.rng.choice(nodes)
            had = self._had(nd)
            self.receipts.append((self.tree.lock(nd), had))

    def _had(self, nd) -> dict[str, bool]:
        """Which checkpoint slots a lock on nd pins (MAMBA pins its checkpoint, if any)."""
        return {c.name: nd.value[c.index] is not None
                for c in self.tree.components if isinstance(c, CheckpointComponent)}

    def unlock(self) -> None:
        if self.receipts:
            rc, _ = self.receipts.pop(self.rng.randrange(len(self.receipts)))
            self.ledger.returned(self.tree.unlock(rc))

    def check_query(self, q=None) -> None:
        H.check_match(self.tree, self.query() if q is None else q, recheck=self.rng.random() < 0.2)

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.45:
            self.insert()
        elif r < 0.65:
            self.evict()
        elif r < 0.72:
            self.lock()
        elif r < 0.8:
            self.unlock()
        else:
            self.check_query()


def page_floor(x: int, P: int) -> int:
    return x - x % P


def page_ceil(x: int, P: int) -> int:
    return -(-x // P) * P


def run_case(seed: int, steps: int, queries_per_step: int = 1, ledger: bool = False,
             P: int | None = None, W: int | None = None) -> int:
    """Drive one random tree; after every step check a few random queries against the
    reference. Returns the number of queries checked."""
    rng = random.Random(seed)
    sim = Sim(rng, P, W)
    checked = 0
    for _ in range(steps):
        sim.step()
        if ledger:
            H.check_useful_leaves(sim.tree)
        for _ in range(queries_per_step):
            sim.check_query()
            checked += 1
    for seq in sim.seqs:  # every inserted sequence, whatever is left of it
        sim.check_query(seq)
        checked += 1
    H.check_structure(sim.tree)
    if ledger:
        sim.ledger.check()
        H.check_locks(sim.tree, sim.receipts)
        while sim.receipts:  # release everything: counts go back to zero
            sim.unlock()
        H.check_locks(sim.tree, [])
        sim.ledger.check()
    return checked


def _run(seeds, steps, qps):
    total = 0
    for seed in seeds:
        try:
            total += run_case(seed, steps, qps)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
    return total


@pytest.mark.parametrize("block", range(4))
def test_match_equals_reference(block):
    """4 x 750 random trees, 20 random operations each, a random query checked after
    every operation and every inserted sequence checked at the end."""
    n = _run(range(block * 750, (block + 1) * 750), steps=20, qps=1)
    assert n >= 750 * 20


@pytest.mark.slow
@pytest.mark.parametrize("block", range(20))
def test_match_equals_reference_slow(block):
    _run(range(100_000 + block * 2000, 100_000 + (block + 1) * 2000), steps=40, qps=2)


@pytest.mark.parametrize("block", range(2))
def test_random_accounting_and_receipts(block):
    """The same random trees, held to the rest of design.md §3: after every operation no
    unlocked leaf is useless; at the end every handle given to the tree is held once or
    handed back once (insert `free`, evict, unlock), lock counts are exactly what the
    live receipts pin (SWA its window, MAMBA one node), `tree.locked` agrees, and
    releasing every receipt brings every count back to zero."""
    for seed in range(50_000 + block * 400, 50_000 + (block + 1) * 400):
        try:
            run_case(seed, steps=25, queries_per_step=0, ledger=True)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e


@pytest.mark.slow
@pytest.mark.parametrize("block", range(10))
def test_random_accounting_and_receipts_slow(block):
    for seed in range(200_000 + block * 2000, 200_000 + (block + 1) * 2000):
        try:
            run_case(seed, steps=40, queries_per_step=1, ledger=True)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e


@pytest.mark.parametrize("P,W", H.WINDOW_CASES)
def test_window_sweep_matches_reference(P, W):
    """Page sizes 1, 2, 3, 4 and 16, windows with W % P in {0, 1, 2, P - 1} and W = 1:
    random inserts (retention checked on each), evictions that tombstone, locks and
    queries, match against the reference after every step; no useless unlocked leaf,
    exact handle accounting and lock counts at the end."""
    for seed in range(40):
        try:
            run_case(P * 1000 + W * 50 + seed, steps=20, queries_per_step=1, ledger=True, P=P, W=W)
        except AssertionError as e:
            raise AssertionError(f"P={P} W={W} seed {seed}: {e}") from e


@pytest.mark.slow
@pytest.mark.parametrize("P,W", H.WINDOW_CASES)
def test_window_sweep_matches_reference_slow(P, W):
    for seed in range(400):
        try:
            run_case(500_000 + P * 10_000 + W * 400 + seed, steps=40, queries_per_step=2, ledger=True,
                     P=P, W=W)
        except AssertionError as e:
            raise AssertionError(f"P={P} W={W} seed {seed}: {e}") from e


@pytest.mark.parametrize("P,W", H.WINDOW_CASES)
def test_retention_keeps_exactly_the_windows_it_resumes_from(P, W):
    """An insert keeps exactly the SWA pages touching [max(0, j - W + 1), j) for its end
    and each junction j (a page more is never needed: W = 1 keeps none), hands the
    rest back, and a later request resumes at every such j."""
    for npages in (1, 2, 5, 9):
        n = npages * P
        for junction in ((), (P,), (page_floor(n // 2, P), n - P)):
            junction = tuple(j for j in junction if 0 < j)
            tree = RadixTree([FullComponent(), SWAComponent(W)], page_size=P)
            seq = list(range(n))
            swa = array("i", range(100, 100 + npages))
            r = tree.insert(seq, {"full": array("i", range(npages)), "swa": swa}, resume_points=junction)
            want = {q for j in {n, *junction} for q in H.page_rule_pages(W, j, P)}
            _, pages, _ = H.per_page(tree, seq)
            assert {q for q, h in enumerate(pages["swa"]) if h is not None} == want, (n, junction)
            assert all(pages["swa"][q] == swa[q] for q in want)
            assert sorted(r.free["swa"]) == [swa[q] for q in range(npages) if q not in want]
            assert tree.size[1] == len(want)
            for j in {n, *junction}:
                assert H.check_match(tree, seq[:j] + [10**6]).boundary == j, (n, junction, j)


@pytest.mark.parametrize("P,W", H.WINDOW_CASES)
def test_tombstone_removes_exactly_the_leaves_whose_window_reaches_it(P, W):
    """A tombstone on a shared node X = [0, s): a leaf below it whose window before its
    end starts at or past s still serves and stays; one whose window reaches back into X
    goes whole (FULL and SWA handed back). Leaves end one page before, at, and one page
    after the first end whose window clears X."""
    s = 2 * P
    stay = page_ceil(s + W - 1, P)  # the first aligned end b with b - W + 1 >= s
    ends = [e for e in (stay - P, stay, stay + P) if e > s]
    # fifo: X, inserted first, is the first SWA victim
    tree = RadixTree([FullComponent(), SWAComponent(W, keep_all=True)], page_size=P, eviction_policy="fifo")
    x = [7] * s
    x_full, x_swa = array("i", range(s // P)), array("i", range(100, 100 + s // P))
    tree.insert(x, {"full": x_full, "swa": x_swa})
    leaves = []
    for i, e in enumerate(ends, 1):
        k = (e - s) // P
        full, swa = array("i", range(1000 * i, 1000 * i + k)), array("i", range(2000 * i, 2000 * i + k))
        toks = x + [i] * (e - s)
        r = tree.insert(toks, {"full": x_full + full, "swa": x_swa + swa}, prefix_len=s)
        assert r.node.end == e
        leaves.append((e, toks, r.node, full, swa))
    ev = tree.evict(swa_pages=1)
    assert ev.tombstones == 1
    gone = [lf for lf in leaves if max(0, lf[0] - W + 1) < s]  # the window reaches into X
    assert sorted(ev.freed["full"]) == sorted(h for *_, full, _ in gone for h in full)
    assert sorted(ev.freed["swa"]) == sorted([*x_swa, *(h for *_, swa in gone for h in swa)])
    for e, toks, leaf, _, _ in leaves:
        serves = max(0, e - W + 1) >= s
        assert leaf.attached == serves, (e, W, P, leaf)
        assert H.check_match(tree, toks).boundary == (e if serves else 0), (e, W, P)
    H.check_structure(tree)
    H.check_useful_leaves(tree)


# --------------------------------------------------------------------------- targeted cases
def _tree(P, W=None, keep_all=True, mamba=True):
    comps = [FullComponent()]
    if W is not None:
        comps.append(SWAComponent(W, keep_all=keep_all))
    if mamba:
        comps.append(MambaComponent())
    return RadixTree(comps, page_size=P)


@pytest.mark.parametrize("P", [1, 2, 4, 8])
@pytest.mark.parametrize("W", [1, 3, 4, 8, 13])
def test_every_single_hole_position(P, W):
    """One SWA page missing, anywhere on a 10-page path, checkpoints everywhere:
    every query prefix agrees with the reference, and the boundary skips exactly the
    positions whose window touches the hole."""
    for hole in range(10):
        tree = _tree(P, W)
        seq = [(7 * i) % 11 for i in range(10 * P)]
        swa = array("i", (-1 if q == hole else 500 + q for q in range(10)))
        # one node per page, so that the hole takes only its own page
        tree.insert(seq, {"full": array("i", range(100, 110)), "swa": swa,
                          "mamba": {P * (q + 1): 700 + q for q in range(10)}}, lock=True)
        for cut in range(0, 10 * P + 1):
            exp = H.check_match(tree, seq[:cut])
            b = exp.matched
            if b == 0:
                continue
            touches = max(0, b - W + 1) < (hole + 1) * P and hole * P < b
            assert (exp.boundary == b) == (not touches)


def test_junction_checkpoint_and_retention_windows():
    """Default retention: SWA kept only in the windows at the end and at the junction;
    a junction checkpoint makes the junction a boundary for the second request's
    siblings."""
    P, W = 2, 4
    tree = _tree(P, W, keep_all=False)
    a = [1] * 16
    tree.insert(a, {"full": array("i", range(8)), "swa": array("i", range(100, 108)),
                    "mamba": {16: 200}})
    H.check_structure(tree)
    exp = H.check_match(tree, a)
    assert exp.boundary == 16
    # SWA of pages outside [12, 16) went at once (the tree returned them)
    exp = H.check_match(tree, a[:10])
    assert exp.matched == 10 and exp.deepest["swa"] == 0 and exp.boundary == 0
    b = a[:10] + [2] * 6
    r = tree.insert(b, {"full": array("i", range(10, 18)), "swa": array("i", range(110, 118)),
                        "mamba": {10: 201, 16: 202}}, resume_points=10)
    assert sorted(r.free["full"]) == list(range(10, 15))
    # the junction window [6, 10) is kept: a third branch at 10 resumes there
    exp = H.check_match(tree, a[:10] + [3] * 6)
    assert (exp.matched, exp.boundary) == (10, 10)
    assert exp.handles["mamba"] == [201]
    assert exp.handles["swa"] == [113, 114]
    exp = H.check_match(tree, b)
    assert exp.boundary == 16
    H.check_structure(tree)
