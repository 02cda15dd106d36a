"""A request's sliding-window pages are taken chunk by chunk as it prefills, not for its
whole prompt at admission (FULL still is, all or nothing): a prompt far longer than the
SWA pool is served, exactly, and reused on the next turn; while it prefills a request
holds at most its window and a chunk of SWA pages; several long prompts on a pool of
about two windows and a chunk all finish, none lost, in a bounded number of steps; the
same through the host tier (L2) and from L3."""
from __future__ import annotations

import random

import pytest
from engine_checks import (
    check_exact,
    check_ownership,
    check_work,
    greedy,
    page_floor,
    run_checked,
    swa_held,
    toks,
)

from uniradix.engine import Engine
from uniradix.hicache.backends.file import FileBackend
from uniradix.model import PRESETS

GEMMA = "gemma3-like"
W = PRESETS[GEMMA].window
CHUNK = 8
SMALL = 0.02  # SWA pool of about 50 tokens beside a FULL pool of thousands


def window_pages(page: int) -> int:
    """The most pages a position's window touches (specs.kv.SlidingWindowKV.window_pages)."""
    return -(-(W - 1) // page) + 1


def holding_bound(page: int) -> int:
    """What one prefilling request may hold of the SWA pool: its window and a chunk."""
    return window_pages(page) + -(-CHUNK // page) + 1


def gemma(make_engine, page, chunk=CHUNK, **kw):
    kw.setdefault("max_total_tokens", 512)
    return make_engine(GEMMA, page_size=page, chunked_prefill_size=chunk, **kw)


def record_swa_at_forward(eng) -> list[int]:
    """The SWA pages requests hold at each forward, when a step's chunks hold the most."""
    seen, forward = [], eng.model.forward

    def recorded(*a, **kw):
        seen.append(swa_held(eng))
        return forward(*a, **kw)

    eng.model.forward = recorded
    return seen


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("page", [1, 4])
def test_a_prompt_far_longer_than_the_swa_pool_is_served_and_reused(make_engine, page, hierarchical):
    eng = gemma(make_engine, page, swa_full_tokens_ratio=SMALL, enable_hierarchical_cache=hierarchical)
    swa = eng.pools["swa"]
    rng = random.Random(30 + page)
    L = 200
    assert swa.size * page * 3 < L, swa.size   # the prompt is many times the pool
    r1 = greedy(toks(rng, L), 6)
    seen = record_swa_at_forward(eng)
    run_checked(eng, [r1])
    check_exact(eng, r1)
    check_work(r1)
    assert max(seen) <= holding_bound(page) < swa.size
    if hierarchical:  # turn 1 leaves the device: turn 2 takes it back from the host
        eng.cache.evict(full_pages=eng.pools["full"].size, swa_pages=swa.size)
        assert eng.cache.tree.offloaded[0] > 0
    p2 = r1.input_ids + r1.output_ids + toks(rng, 50)
    r2 = greedy(p2, 6)
    run_checked(eng, [r2])
    check_exact(eng, r2)
    check_work(r2)
    want = page_floor(L + len(r1.output_ids) - 1, page)
    assert r2.metrics.cached_tokens == want, (r2.metrics, want)
    if hierarchical:
        assert r2.metrics.host_tokens == want
    assert eng.counters["errors"] == 0


@pytest.mark.parametrize("page", [1, 4])
def test_a_prefilling_request_holds_its_window_and_a_chunk(make_engine, page):
    """With room for the whole prompt (the 1:1 pool), a request still takes only the
    window pages each chunk reads, and gives back what falls out of the window."""
    eng = gemma(make_engine, page)
    swa = eng.pools["swa"]
    rng = random.Random(40 + page)
    L = 200
    assert swa.size * page >= L
    req = greedy(toks(rng, L), 3)
    seen = record_swa_at_forward(eng)
    eng.submit(req)
    between = []
    for _ in range(1000):
        if not (eng.running or eng.waiting):
            break
        eng.step()
        check_ownership(eng)
        if eng.running:
            between.append(swa_held(eng))
    assert len(seen) >= L // CHUNK, "the prompt was not computed chunk by chunk"
    assert max(seen) <= holding_bound(page), (max(seen), holding_bound(page))
    assert max(between) <= holding_bound(page)
    check_exact(eng, req)
    check_work(req)


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("page", [1, 4])
def test_several_long_prompts_on_two_windows_and_a_chunk(make_engine, page, hierarchical):
    """Four long prompts at once on an SWA pool of about two windows and a chunk: they
    take turns for the window pages (a chunk shrinks, waits, or the newest is preempted
    with what it computed cached), and all are served exactly."""
    ratio = 0.014 if page == 1 else 0.02
    eng = gemma(make_engine, page, swa_full_tokens_ratio=ratio, enable_hierarchical_cache=hierarchical)
    swa = eng.pools["swa"]
    two_and_a_chunk = 2 * window_pages(page) + -(-CHUNK // page)
    assert two_and_a_chunk <= swa.size <= two_and_a_chunk + 4, (swa.size, two_and_a_chunk)
    rng = random.Random(50 + page)
    reqs = [greedy(toks(rng, n), 16) for n in (150, 120, 170, 96)]
    seen = run_checked(eng, reqs)
    assert seen["max_running"] > 2, "the requests did not compete for the pool"
    assert seen["steps"] < 2000
    for r in reqs:
        check_exact(eng, r)
        check_work(r)
    assert eng.counters["errors"] == 0 and eng.counters["finished"] == len(reqs)
    # and the next turns reuse what they cached
    nxt = [greedy(r.input_ids + r.output_ids + toks(rng, 9), 3) for r in reqs]
    run_checked(eng, nxt)
    for r in nxt:
        check_exact(eng, r)
    assert sum(r.metrics.cached_tokens for r in nxt) > 0


def prefilling(eng, n: int, steps: int = 200):
    """Step until `n` running requests are all part way through their prompts."""
    for _ in range(steps):
        sts = [st for st in eng.running if 0 < st.computed < st.prompt_len]
        if len(sts) >= n:
            return sts
        eng.step()
        check_ownership(eng)
    raise AssertionError(f"never {n} requests prefilling at once")


def test_when_every_prefill_waits_for_window_pages_the_newest_is_preempted(make_engine):
    """Two requests part way through their prompts and not one free SWA page (held
    elsewhere, as other requests' windows would be): rather than wait for each other
    for ever, the newer is preempted, the prefix it computed cached, and the older goes
    on at once; both finish exactly."""
    eng = gemma(make_engine, 1, chunk=32, swa_full_tokens_ratio=0.014)  # a step's budget has room for both
    swa = eng.pools["swa"]
    rng = random.Random(80)
    old, new = greedy(toks(rng, 150), 3), greedy(toks(rng, 120), 3)
    for r in (old, new):
        eng.submit(r)
    a = min(prefilling(eng, 2), key=lambda st: st.order)
    done_a = a.computed
    tree = eng.cache.tree
    eng.cache.evict(swa_pages=tree.evictable("swa"))  # the spare windows go first
    hog = swa.alloc(swa.available)  # every free window page taken
    evicted = tree.evicted[tree.index["swa"]]
    try:
        eng.step()
        assert new.metrics.preemptions == 1 and new.status == "preempted"
        assert old.metrics.preemptions == 0 and a.computed > done_a, "the older did not go on"
        assert tree.evicted[tree.index["swa"]] > evicted, "its cached window was not given to the older"
    finally:
        swa.free(hog)
    run_checked(eng, [])
    for r in (old, new):
        check_exact(eng, r)
    assert new.metrics.computed_tokens >= len(new.input_ids) - new.metrics.cached_tokens


def test_a_prefill_alone_without_a_window_page_fails_clearly(make_engine):
    """Alone and with not one SWA page to be had, a prefill can never go on: it fails,
    naming the pool, rather than wait for ever; the next request is served."""
    eng = gemma(make_engine, 4, swa_full_tokens_ratio=SMALL)
    swa = eng.pools["swa"]
    rng = random.Random(81)
    big = greedy(toks(rng, 120), 3)
    eng.submit(big)
    prefilling(eng, 1)
    hog = swa.alloc(swa.available)
    try:
        eng.step()
    finally:
        swa.free(hog)
    assert big.status == "error" and "can never fit" in big.error and "swa" in big.error, big.error
    assert not eng.running
    small = greedy(toks(rng, 20), 2)
    run_checked(eng, [small])
    check_exact(eng, small)


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("page", [1, 4])
def test_a_long_prompt_read_from_l3_on_a_small_swa_pool(tmp_path, page, hierarchical):
    """Engine a computes a long conversation turn and writes it to L3; a fresh engine
    with an SWA pool far smaller than the prompt reads it back (straight into its pages,
    or through the host tier): the window before the resume point is taken once the
    read says where that is, and the reply is exact."""
    rng = random.Random(70 + page)
    kw = dict(page_size=page, max_total_tokens=512, chunked_prefill_size=CHUNK, prefetch_threshold=1,
              swa_full_tokens_ratio=SMALL, enable_hierarchical_cache=hierarchical)
    a = Engine(GEMMA, storage=FileBackend(str(tmp_path)), **kw)
    r1 = greedy(toks(rng, 200), 5)
    a.run([r1])
    check_exact(a, r1)
    assert a.stats()["storage_saved_objects"] > 0
    b = Engine(GEMMA, storage=FileBackend(str(tmp_path)), **kw)
    assert b.pools["swa"].size * page * 3 < 200
    r2 = greedy(r1.input_ids + r1.output_ids + toks(rng, 30), 5)
    b.run([r2])
    check_exact(b, r2)
    check_work(r2)
    want = page_floor(len(r1.input_ids) + len(r1.output_ids) - 1, page)
    assert r2.metrics.cached_tokens == r2.metrics.storage_tokens == want, r2.metrics
    if hierarchical:
        assert b.cache.stats()["host"]["staged_from_storage"] > 0
    check_ownership(b)
    for e in (a, b):
        e.close()
