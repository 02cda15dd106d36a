"""The engine over the host tier (L2, design.md §4): what the device evicts stays in host
memory and comes back (all or nothing, layer by layer under the forward) when a later
request reuses it, and every token stays exact: logits equal the no-cache oracle's,
greedy tokens are its argmax, and a request computes exactly the prompt tokens past its
boundary (so host tokens were reused, not recomputed). Every preset and page size, each
write policy, host pressure (a host barely larger than the device), host + L3 together,
and preemption. Ownership of every device and host handle is checked after every step
(run_checked), and the make_engine fixture checks settle + flush when each test ends."""
from __future__ import annotations

import random

import pytest
from engine_checks import (full_budget, 
    PAGE_SIZES,
    PRESET_NAMES,
    check_exact,
    check_work,
    greedy,
    has_kind,
    page_floor,
    run_checked,
    toks,
)

grid = pytest.mark.parametrize("page", PAGE_SIZES)
presets = pytest.mark.parametrize("name", PRESET_NAMES)


def hier(make_engine, name, page, **kw):
    kw.setdefault("enable_hierarchical_cache", True)
    kw.setdefault("hicache_ratio", 4.0)
    return make_engine(name, page_size=page, **kw)


def path_nodes(tree, tokens):
    """The tree's nodes along `tokens`, read-only (a match would split and touch)."""
    from uniradix.tree import encode
    key = encode(list(tokens))
    nd, off, out = tree.root(None), 0, []
    while True:
        ch = nd.children.get(key[off:off + tree.unit])
        if ch is None or not key.startswith(ch.key, off):
            return out
        out.append(ch)
        off += len(ch.key)
        nd = ch


def conversations(eng, rng, n, turns, first=30, new=12, out=4):
    """n conversations advanced together, one turn each round (all submitted at once, so
    they compete for the pools); every request checked. Returns the requests."""
    convs = [toks(rng, first) for _ in range(n)]
    done = []
    for _ in range(turns):
        reqs = [greedy(c, out) for c in convs]
        run_checked(eng, reqs)
        for r in reqs:
            check_exact(eng, r)
            check_work(r)
            assert 0 <= r.metrics.host_tokens <= r.metrics.cached_tokens, r.metrics
        done += reqs
        convs = [r.input_ids + r.output_ids + toks(rng, new) for r in reqs]
    return done


def assert_host_used(eng, reqs):
    s = eng.stats()
    host = sum(r.metrics.host_tokens for r in reqs)
    assert host > 0, "no request reused anything from the host tier"
    assert s["host_tokens"] == host
    assert s["cache"]["host"]["loads"] > 0 and s["cache"]["host"]["loaded_handles"] > 0
    assert eng.cache.tree.offloaded[0] > 0, "the device never evicted to the host"
    assert s["errors"] == 0


# --------------------------------------------------------------------------- served from L2
@presets
@grid
def test_an_evicted_turn_comes_back_from_the_host_whole(make_engine, name, page):
    """Turn 1, then enough other traffic that the device evicts all of turn 1 (its
    pages, window and checkpoint go host-only); turn 2 reuses exactly what it would have
    reused from the device (the last full page of what turn 1 computed), all of it from
    the host, and computes only the rest."""
    eng = hier(make_engine, name, page, max_total_tokens=full_budget(name, 128, page, swa_full_tokens_ratio=0.5),
               hicache_ratio=8.0, swa_full_tokens_ratio=0.5, max_mamba_cache_size=8)
    rng = random.Random(1)
    p1 = toks(rng, 24)
    r1 = greedy(p1, 5)
    run_checked(eng, [r1])
    check_exact(eng, r1)
    for _ in range(4):
        other = greedy(toks(rng, 40), 3)
        run_checked(eng, [other])
        check_exact(eng, other)
    tree = eng.cache.tree
    nodes = path_nodes(tree, p1 + r1.output_ids[:-1])
    assert nodes, "turn 1 left the tree"
    assert all(nd.value[0] is None and nd.host[0] is not None for nd in nodes), \
        "the test needs turn 1's FULL pages on the host only"
    if has_kind(name, "S"):
        assert tree.offloaded[tree.index["swa"]] > 0
    p2 = p1 + r1.output_ids + toks(rng, 7)
    r2 = greedy(p2, 5)
    run_checked(eng, [r2])
    check_exact(eng, r2)
    check_work(r2)
    want = page_floor(min(len(p1) + len(r1.output_ids) - 1, len(p2) - 1), page)
    assert r2.metrics.cached_tokens == want, (r2.metrics, want)
    assert r2.metrics.host_tokens == want
    assert r2.metrics.computed_tokens == len(p2) - want
    assert eng.stats()["host_tokens"] == want
    assert eng.cache.stats()["host"]["failed_loads"] == 0
    # loaded back: the path is on the device again (and still on the host)
    assert all(nd.value[0] is not None and nd.host[0] is not None for nd in path_nodes(tree, p2[:want]))


@presets
@grid
def test_conversations_under_pressure_served_from_the_host_stay_exact(make_engine, name, page):
    """Six conversations on device pools that hold about two, a host four times larger:
    turns come back from the host, requests wait, are preempted and evicted, and every
    token stays exact."""
    eng = hier(make_engine, name, page, max_total_tokens=320, max_mamba_cache_size=24)
    reqs = conversations(eng, random.Random(13), n=6, turns=3)
    assert_host_used(eng, reqs)
    assert eng.cache.tree.evicted[0] > 0


# --------------------------------------------------------------------------- write policies
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("name", ["tiny-hybrid", "jamba-like", "gemma3-like", "full-only"])
def test_each_write_policy_stays_exact_and_serves_from_the_host(make_engine, name, policy):
    eng = hier(make_engine, name, 4, max_total_tokens=320, max_mamba_cache_size=24,
               hicache_write_policy=policy)
    reqs = conversations(eng, random.Random(21), n=6, turns=3)
    assert_host_used(eng, reqs)
    h = eng.cache.stats()["host"]
    assert h["write_policy"] == policy
    if policy == "write_back":
        assert h["written_back"] > 0 and h["written_handles"] == 0
    else:
        assert h["written_handles"] > 0 and h["written_back"] == 0


def test_selective_write_through_writes_less_than_write_through(make_engine):
    """Same traffic: the selective policy copies only what was accessed twice, so it
    writes fewer handles to the host, and never a node accessed once."""
    written = {}
    for policy in ("write_through", "write_through_selective"):
        eng = hier(make_engine, "tiny-hybrid", 4, max_total_tokens=320, max_mamba_cache_size=24,
                   hicache_write_policy=policy, write_through_threshold=2)
        conversations(eng, random.Random(22), n=6, turns=3)
        written[policy] = eng.cache.stats()["host"]["written_handles"]
        if policy == "write_through_selective":
            for nd in eng.cache.tree.nodes():
                if nd.hits < 2:
                    assert all(h is None for h in nd.host), nd
    assert 0 < written["write_through_selective"] < written["write_through"], written


def test_write_back_writes_only_what_leaves_the_device(make_engine):
    """With room to spare nothing is ever evicted, so write_back writes nothing; the
    cache still serves every turn from the device."""
    eng = hier(make_engine, "tiny-hybrid", 4, max_total_tokens=4096, hicache_write_policy="write_back")
    reqs = conversations(eng, random.Random(23), n=3, turns=2)
    h = eng.cache.stats()["host"]
    assert h["written_back"] == 0 and h["written_handles"] == 0 and h["loads"] == 0
    assert eng.cache.tree.host_size == [0] * eng.cache.tree.nc
    assert sum(r.metrics.cached_tokens for r in reqs) > 0
    assert sum(r.metrics.host_tokens for r in reqs) == 0


# --------------------------------------------------------------------------- host pressure
def _host_pressure(make_engine, name, page, policy):
    eng = hier(make_engine, name, page, max_total_tokens=320, max_mamba_cache_size=24,
               hicache_ratio=1.2, hicache_write_policy=policy)
    reqs = conversations(eng, random.Random(13), n=8, turns=4)
    assert_host_used(eng, reqs)
    tree = eng.cache.tree
    if policy != "write_through_selective":  # it writes too little to fill the host
        assert tree.host_evicted[0] > 0, tree.stats()
    for c, hp in zip(tree.components, eng.cache.host_pools):
        assert tree.host_size[c.index] <= hp.size


# every preset once, every page size and both policies somewhere (the full grid is slow)
PRESSURE = [(n, 4, "write_through") for n in PRESET_NAMES] + \
    [("tiny-hybrid", 1, "write_back"), ("gemma3-like", 4, "write_back"), ("full-only", 16, "write_back"),
     ("tiny-hybrid", 16, "write_through"), ("jamba-like", 1, "write_back")]


@pytest.mark.parametrize("name,page,policy", PRESSURE)
def test_host_pressure_evicts_from_the_host_and_stays_exact(make_engine, name, page, policy):
    """A host tier only 1.2 times the device: it fills up and evicts host copies and
    host-only nodes (host_evicted), loads still happen, nothing leaks in either tier
    (checked every step and at the end), and every token is exact."""
    _host_pressure(make_engine, name, page, policy)


@pytest.mark.slow
@presets
@grid
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_host_pressure_full_grid(make_engine, name, page, policy):
    _host_pressure(make_engine, name, page, policy)


@pytest.mark.parametrize("name", ["tiny-hybrid", "gemma3-like"])
def test_write_back_with_a_small_host_never_refuses_a_request_that_fits(make_engine, name):
    """write_back with a host tier just larger than the device, long conversations and
    few running requests: eviction must keep making device room (backing up what it can,
    evicting host data for it), so no request that fits the pools fails. (Regression:
    write-back that only made host room for the shortfall left the device unable to
    evict, and requests failed with 'can never fit'.)"""
    eng = hier(make_engine, name, 4, max_total_tokens=256, max_mamba_cache_size=16, hicache_ratio=1.1,
               hicache_write_policy="write_back", max_running_requests=4)
    reqs = conversations(eng, random.Random(1001), n=7, turns=5, first=31, new=19, out=6)
    assert all(r.status == "finished" for r in reqs) and eng.stats()["errors"] == 0
    assert eng.cache.stats()["host"]["written_back"] > 0 and eng.cache.tree.host_evicted[0] > 0


# --------------------------------------------------------------------------- L1 + L2 + L3
@pytest.mark.parametrize("name", ["tiny-hybrid", "jamba-like", "gemma3-like", "full-only"])
@pytest.mark.parametrize("page", [1, 4])
def test_device_host_and_storage_together(make_engine, tmp_path, name, page):
    """Engine A with the host tier and a file store, under pressure: exact, serves from
    the host, writes the store. A fresh engine B over the same store (its device and
    host empty) resumes a conversation from the store, exactly, and then serves it again
    from its own tiers."""
    from uniradix.hicache.backends.file import FileBackend
    a = hier(make_engine, name, page, max_total_tokens=320, max_mamba_cache_size=24,
             storage=FileBackend(str(tmp_path)), prefetch_threshold=page,
             hicache_storage_prefetch_policy="wait_complete")
    try:
        reqs = conversations(a, random.Random(31), n=6, turns=3)
        assert_host_used(a, reqs)
        assert a.stats()["storage_saved_objects"] > 0
    finally:
        a.close()
    last = reqs[-1]
    b = hier(make_engine, name, page, max_total_tokens=320, max_mamba_cache_size=24,
             storage=FileBackend(str(tmp_path)), prefetch_threshold=page,
             hicache_storage_prefetch_policy="wait_complete")
    try:
        nxt = last.input_ids + last.output_ids + toks(random.Random(32), 9)
        r = greedy(nxt, 4)
        run_checked(b, [r])
        check_exact(b, r)
        check_work(r)
        done = len(last.input_ids) + len(last.output_ids) - 1  # what engine a computed
        assert r.metrics.storage_tokens == r.metrics.cached_tokens == page_floor(done, page), r.metrics
        assert b.stats()["storage_tokens"] > 0
        again = greedy(nxt, 2)
        run_checked(b, [again])
        check_exact(b, again)
        assert again.metrics.storage_tokens == 0 and again.metrics.cached_tokens >= r.metrics.cached_tokens
    finally:
        b.close()


@pytest.mark.parametrize("name", ["tiny-hybrid", "qwen3-next-like", "gemma3-like", "full-only"])
def test_pressure_over_host_and_storage_stays_exact(make_engine, tmp_path, name):
    """One engine with all three tiers and pools that hold about two conversations of
    eight: turns come from the device, the host or the store; all exact."""
    from uniradix.hicache.backends.file import FileBackend
    eng = hier(make_engine, name, 4, max_total_tokens=320, max_mamba_cache_size=24, hicache_ratio=1.5,
               storage=FileBackend(str(tmp_path)), prefetch_threshold=4,
               hicache_storage_prefetch_policy="wait_complete")
    try:
        reqs = conversations(eng, random.Random(33), n=8, turns=4)
    finally:
        eng.close()
    s = eng.stats()
    assert s["errors"] == 0 and s["host_tokens"] > 0 and s["storage_tokens"] > 0
    # counted once per request, at its first admission, preempted or not (it may read L3 again)
    assert sum(r.metrics.storage_tokens for r in reqs) == s["storage_tokens"]
    assert sum(r.metrics.cross_instance_tokens for r in reqs) == s["storage_cross_instance_tokens"] == 0  # its own
    assert eng.cache.tree.host_evicted[0] > 0


def _host_then_store(make_engine, tmp_path, name, page):
    """Engine e1 (host tier + store) runs turn 1, then other traffic evicts turn 1 from
    its device (host-only now: pages and checkpoint). Engine e2 (store only) runs turn 2
    and writes it to the store. Returns e1 and turn 3's prompt, which e1 can resume from
    its host (turn 1) and then deeper from the store (turn 2)."""
    from uniradix.hicache.backends.file import FileBackend
    kw = {"max_total_tokens": 128, "max_mamba_cache_size": 8, "prefetch_threshold": page,
          "hicache_storage_prefetch_policy": "wait_complete"}
    e1 = hier(make_engine, name, page, hicache_ratio=8.0, storage=FileBackend(str(tmp_path)), **kw)
    e2 = make_engine(name, page_size=page, storage=FileBackend(str(tmp_path)), **kw)
    rng = random.Random(1)
    p1 = toks(rng, 24)
    r1 = greedy(p1, 5)
    run_checked(e1, [r1])
    p2 = p1 + r1.output_ids + toks(rng, 20)
    r2 = greedy(p2, 5)
    run_checked(e2, [r2])
    check_exact(e2, r2)
    assert r2.metrics.storage_tokens > 0
    e2.close()
    for _ in range(4):
        run_checked(e1, [greedy(toks(rng, 40), 3)])
    nodes = path_nodes(e1.cache.tree, p1 + r1.output_ids[:-1])
    assert nodes and all(nd.value[0] is None and nd.host[0] is not None for nd in nodes)
    if has_kind(name, "M"):
        ci = e1.cache.tree.index["mamba"]
        assert nodes[-1].value[ci] is None and nodes[-1].host[ci] is not None, \
            "the test needs turn 1's end checkpoint on the host only"
    return e1, p2 + r2.output_ids + toks(rng, 6), len(p2) + len(r2.output_ids) - 1


@pytest.mark.parametrize("name", ["tiny-hybrid", "jamba-like", "gemma3-like", "full-only"])
def test_resume_from_the_host_then_deeper_from_the_store(make_engine, tmp_path, name):
    """One request takes its prefix from all tiers: turn 1 loaded from the host, turn 2
    read from the store past it; exact, and it computes only the rest."""
    page = 4
    e1, p3, done2 = _host_then_store(make_engine, tmp_path, name, page)
    try:
        r3 = greedy(p3, 4)
        run_checked(e1, [r3])
        check_exact(e1, r3)
        check_work(r3)
    finally:
        e1.close()
    m = r3.metrics
    assert m.host_tokens > 0 and m.storage_tokens > 0, m
    assert m.cached_tokens == page_floor(done2, page), m


class WrongLogits(AssertionError):
    """check_exact failed (a type of its own, so the test says what went wrong)."""


@pytest.mark.parametrize("name", ["jamba-like", "tiny-hybrid"])
def test_a_slow_host_load_does_not_overwrite_the_state_read_from_the_store(make_engine, tmp_path,
                                                                           monkeypatch, name):
    """As above, but the host load's copy thread is slow: it only runs once whatever
    else writes the request's pages has finished, unless someone waits for it first (a
    correct engine orders the store's data after it, and then nothing is delayed)."""
    import threading

    import uniradix.hicache.l2 as cache_mod  # where the host tier starts its loads
    page = 4
    e1, p3, _ = _host_then_store(make_engine, tmp_path, name, page)
    gate = threading.Event()
    made = []

    class SlowFirst(cache_mod.LayerwiseLoad):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

        def _run(self):
            if self is made[0]:
                gate.wait(10)
            super()._run()

        def _release(self):
            if self is made[0] and not gate.is_set():
                if len(made) > 1:  # a second load is already under way: it ends first
                    made[1].wait_all()
                gate.set()

        def wait(self, layer_id):
            self._release()
            super().wait(layer_id)

        def wait_all(self):
            self._release()
            super().wait_all()

    monkeypatch.setattr(cache_mod, "LayerwiseLoad", SlowFirst)
    try:
        r3 = greedy(p3, 4)
        run_checked(e1, [r3])
    finally:
        gate.set()
        e1.close()
    assert r3.metrics.host_tokens > 0 and r3.metrics.storage_tokens > 0, r3.metrics
    assert len(made) >= 1 and gate.is_set()
    try:
        check_exact(e1, r3)
    except AssertionError as e:
        raise WrongLogits(str(e)) from None


# --------------------------------------------------------------------------- preemption
@presets
@grid
def test_preemption_with_the_host_tier_stays_exact(make_engine, name, page):
    """Three prompts fit at admission, a fourth waits, and the three cannot all grow:
    the newest decoding request is preempted, its work cached (and written to the host),
    evicted from the device while the others run, and loaded back from the host when it
    resumes."""
    rng = random.Random(5)
    L, out = 30, 8
    reqs = [greedy(toks(rng, L), out) for _ in range(4)]
    pages = 3 * -(-L // page) + 1
    eng = hier(make_engine, name, page, max_total_tokens=pages * page, max_mamba_cache_size=8,
               hicache_ratio=3.0)
    run_checked(eng, reqs)
    s = eng.stats()
    assert s["preemptions"] > 0
    for r in reqs:
        check_exact(eng, r)
        check_work(r)
        assert len(r.output_ids) == out and r.finish_reason == "length"
    assert s["cache"]["host"]["loads"] > 0, "nothing came back from the host"
    assert eng.cache.tree.offloaded[0] > 0


# --------------------------------------------------------------------------- flags
def test_hierarchical_flags_fail_clearly():
    from uniradix.engine import Engine
    with pytest.raises(ValueError, match="--hicache-ratio"):
        Engine("tiny-hybrid", enable_hierarchical_cache=True, hicache_ratio=1.0)
    with pytest.raises(ValueError, match="--hicache-ratio"):
        Engine("tiny-hybrid", enable_hierarchical_cache=True, hicache_ratio=0.5)
    with pytest.raises(ValueError, match="--hicache-size"):
        Engine("tiny-hybrid", max_total_tokens=256, enable_hierarchical_cache=True, hicache_size=1e-7)
    with pytest.raises(ValueError, match="--hicache-write-policy must be one of .*, got 'write_around'"):
        Engine("tiny-hybrid", enable_hierarchical_cache=True, hicache_write_policy="write_around")
    with pytest.raises(ValueError, match="--write-through-threshold must be a positive integer"):
        Engine("tiny-hybrid", enable_hierarchical_cache=True, hicache_write_policy="write_through_selective",
               write_through_threshold=0)


def test_hicache_size_sizes_the_host_tier(make_engine):
    eng = make_engine("tiny-hybrid", max_total_tokens=256, enable_hierarchical_cache=True,
                      hicache_ratio=1.0, hicache_size=0.005)  # the size overrides the ratio
    assert eng.hierarchical
    device = sum(p.nbytes for p in eng.pools.values())
    host = sum(hp.nbytes for hp in eng.cache.host_pools)
    assert device < host <= 0.005 * 2**30


def test_no_host_tier_without_the_flag_or_the_radix_cache(make_engine):
    assert make_engine("tiny-hybrid").cache.host_pools is None
    off = make_engine("tiny-hybrid", enable_hierarchical_cache=True, disable_radix_cache=True)
    assert off.cache.host_pools is None and not off.hierarchical
    r = greedy(toks(random.Random(3), 12), 3)
    run_checked(off, [r])
    check_exact(off, r)


# --------------------------------------------------------------------------- slow
@pytest.mark.slow
@presets
@grid
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_random_conversations_over_the_host_tier(make_engine, name, page, seed, policy):
    """Randomized: pool sizes, host ratio (pressure or not), conversation counts and
    lengths, chunked prefill and running limits."""
    rng = random.Random(1000 + seed)
    eng = hier(make_engine, name, page, max_total_tokens=rng.choice([256, 320, 512]) // page * page,
               max_mamba_cache_size=rng.choice([16, 24, 48]), hicache_ratio=rng.choice([1.1, 1.5, 3.0]),
               hicache_write_policy=policy, chunked_prefill_size=rng.choice([16, 64, 256]),
               max_running_requests=rng.choice([2, 4, 16]), swa_full_tokens_ratio=rng.choice([0.75, 1.0]))
    reqs = conversations(eng, rng, n=rng.randrange(4, 10), turns=rng.randrange(3, 6),
                         first=rng.randrange(8, 50), new=rng.randrange(1, 20), out=rng.randrange(1, 8))
    assert eng.stats()["errors"] == 0
    assert sum(r.metrics.host_tokens for r in reqs) == eng.stats()["host_tokens"]


@pytest.mark.slow
@presets
@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("seed", range(2))
def test_random_host_and_storage(make_engine, tmp_path, name, page, seed):
    from uniradix.hicache.backends.file import FileBackend
    rng = random.Random(2000 + seed)
    kw = {"max_total_tokens": 320, "max_mamba_cache_size": 24, "hicache_ratio": rng.choice([1.2, 2.0]),
          "prefetch_threshold": page, "hicache_storage_prefetch_policy": "wait_complete"}
    eng = hier(make_engine, name, page, storage=FileBackend(str(tmp_path)), **kw)
    try:
        reqs = conversations(eng, rng, n=rng.randrange(4, 9), turns=rng.randrange(2, 5))
    finally:
        eng.close()
    fresh = hier(make_engine, name, page, storage=FileBackend(str(tmp_path)), **kw)
    try:
        last = reqs[-1]
        r = greedy(last.input_ids + last.output_ids + toks(rng, 5), 3)
        run_checked(fresh, [r])
        check_exact(fresh, r)
        check_work(r)
        assert r.metrics.storage_tokens > 0
    finally:
        fresh.close()
