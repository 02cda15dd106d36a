"""Reuse is exact: whatever the cache hands a request (pages, a window, a copied
checkpoint), the logits it samples from equal the no-cache oracle's
(`reference_forward` over prompt + output[:-1]) within 1e-4, and greedy tokens are the
oracle's argmax. Every preset, fp32 on CPU, page sizes 1, 4 and 16; multi-turn,
branching, concurrent batches and pools small enough to evict, tombstone, lose
checkpoints and preempt. Every engine is also checked for exact handle ownership when
its test ends (conftest)."""
from __future__ import annotations

import random

import pytest

from engine_checks import (PAGE_SIZES, PRESET_NAMES, check_exact, full_budget, check_ownership, check_work, diverging,
                           greedy, has_kind, page_floor, run_checked, toks)

grid = pytest.mark.parametrize("page", PAGE_SIZES)
presets = pytest.mark.parametrize("name", PRESET_NAMES)


def _computed_seq(req) -> list[int]:
    """The tokens whose state a finished request computed (and the tree may keep)."""
    return list(req.input_ids) + list(req.output_ids[:-1])


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------------- multi-turn
def _multi_turn(make_engine, name, page, seed, rounds, first, new, out):
    eng = make_engine(name, page_size=page)
    rng = random.Random(seed)
    prompt = toks(rng, first)
    prev = None
    for turn in range(rounds):
        req = greedy(prompt, out)
        eng.run([req])
        check_exact(eng, req)
        check_work(req)
        if prev is None:
            assert req.metrics.cached_tokens == 0
        else:
            # the previous turn's computed tokens are all in the tree, its state included
            # (end window, end / prompt-end checkpoint): reuse reaches their last full page
            want = page_floor(min(len(_computed_seq(prev)), len(prompt) - 1), page)
            assert req.metrics.cached_tokens == want, (turn, req.metrics, want)
            assert req.metrics.computed_tokens == len(prompt) - want
        check_ownership(eng)
        prev = req
        prompt = prompt + req.output_ids + toks(rng, new)
    return eng


@presets
@grid
def test_multi_turn_conversation_is_exact(make_engine, name, page):
    _multi_turn(make_engine, name, page, seed=1, rounds=4, first=24, new=7, out=5)


@pytest.mark.slow
@presets
@grid
@pytest.mark.parametrize("seed", range(3))
def test_multi_turn_long_random(make_engine, name, page, seed):
    rng = random.Random(100 + seed)
    _multi_turn(make_engine, name, page, seed=seed, rounds=8, first=rng.randrange(10, 80),
                new=rng.randrange(1, 30), out=rng.randrange(1, 24))


# --------------------------------------------------------------------------- branching
def _branching(make_engine, name, page, seed, trunk_len, branches, out, **engine_kw):
    eng = make_engine(name, page_size=page, **engine_kw)
    rng = random.Random(seed)
    trunk = toks(rng, trunk_len)
    # branch points: page-aligned, one past and one before a page boundary, and random
    aligned = [k for k in range(page, trunk_len, page)] or [trunk_len // 2]
    ks = [rng.choice(aligned), min(trunk_len - 1, rng.choice(aligned) + 1),
          max(1, rng.choice(aligned) - 1)]
    ks += [rng.randrange(1, trunk_len) for _ in range(branches - len(ks))]
    done = []
    first = greedy(trunk, out)
    eng.run([first])
    check_exact(eng, first)
    done.append(first)
    for k in ks:
        prompt = trunk[:k] + diverging(rng, rng.randrange(3, 12), [trunk[k]])
        req = greedy(prompt, out)
        eng.run([req])
        check_exact(eng, req)
        check_work(req)
        # never more than what some earlier request computed, page-aligned
        best = max(_lcp(prompt, _computed_seq(d)) for d in done)
        bound = page_floor(min(best, len(prompt) - 1), page)
        assert req.metrics.cached_tokens <= bound, (k, req.metrics, bound)
        if name == "full-only":  # nothing but FULL: reuse reaches the whole shared prefix
            assert req.metrics.cached_tokens == bound, (k, req.metrics, bound)
        done.append(req)
        check_ownership(eng)
    return eng, done


@presets
@grid
def test_branching_at_random_points_is_exact(make_engine, name, page):
    eng, done = _branching(make_engine, name, page, seed=2, trunk_len=40, branches=6, out=4)
    assert sum(r.metrics.cached_tokens for r in done) > 0, "nothing was ever reused"


@pytest.mark.slow
@presets
@grid
@pytest.mark.parametrize("seed", range(3))
def test_branching_long_random(make_engine, name, page, seed):
    _branching(make_engine, name, page, seed=50 + seed, trunk_len=120, branches=25, out=8)


# --------------------------------------------------------------------------- concurrency
def _batch(rng, trunk, n, out):
    reqs = []
    for i in range(n):
        k = rng.randrange(1, len(trunk))
        reqs.append(greedy(trunk[:k] + diverging(rng, rng.randrange(2, 16), [trunk[k]]), out))
    reqs.append(greedy(trunk, out))
    reqs.append(greedy(trunk, out))  # the same prompt twice, in flight together
    return reqs


@presets
@grid
def test_concurrent_batch_sharing_prefixes_is_exact(make_engine, name, page):
    # a small prefill budget so prefill chunks and decodes share steps
    eng = make_engine(name, page_size=page, chunked_prefill_size=24, max_running_requests=8)
    rng = random.Random(3)
    trunk = toks(rng, 36)
    warm = greedy(trunk[:20] + toks(rng, 5), 3)  # something cached before the batch comes
    eng.run([warm])
    check_exact(eng, warm)
    wave1 = _batch(rng, trunk, 5, 5)
    wave2 = _batch(rng, trunk, 3, 4)
    for r in wave1:
        eng.submit(r)
    later = list(wave2)
    steps, most = 0, 0
    while eng.waiting or eng.running or later:
        if steps == 2:  # a second wave arrives while the first is in flight
            assert eng.running
            for r in later:
                eng.submit(r)
            later = []
        eng.step()
        steps += 1
        most = max(most, len(eng.running))
        check_ownership(eng)
    assert most >= 4, f"at most {most} requests were in flight together"
    for r in wave1 + wave2:
        check_exact(eng, r)
        check_work(r)
    for wave in (wave1, wave2):  # the same prompt twice gives the same tokens
        assert wave[-1].output_ids == wave[-2].output_ids
    assert sum(r.metrics.cached_tokens for r in wave1 + wave2) > 0  # the warm request's prefix


@presets
@grid
def test_run_many_requests_at_once_is_exact(make_engine, name, page):
    eng = make_engine(name, page_size=page, max_running_requests=16)
    rng = random.Random(4)
    trunk = toks(rng, 30)
    reqs = _batch(rng, trunk, 6, 4)
    seen = run_checked(eng, reqs)
    assert seen["max_running"] >= 2
    for r in reqs:
        check_exact(eng, r)
        check_work(r)
        assert r.metrics.cached_tokens == 0  # all arrived before anything was cached


# --------------------------------------------------------------------------- pressure
def _pressure(make_engine, name, page, seed, trunk_len=48, branches=10, out=4, ratio=0.5, mamba=8,
              room=3):
    """A trunk and many branches off it, two at a time, through pools that hold about
    `room` requests: eviction, SWA tombstones and lost checkpoints all happen mid-run."""
    rng = random.Random(seed)
    trunk = toks(rng, trunk_len)
    reqs = [greedy(trunk, out)]
    for _ in range(branches):
        k = rng.randrange(8, trunk_len)
        reqs.append(greedy(trunk[:k] + diverging(rng, rng.randrange(4, 12), [trunk[k]]), out))
    longest = max(len(r.input_ids) for r in reqs) + out
    full = full_budget(name, page * -(-(room * longest) // page), page, swa_full_tokens_ratio=ratio, max_running=2)
    eng = make_engine(name, page_size=page, max_total_tokens=full,
                      swa_full_tokens_ratio=ratio, max_mamba_cache_size=mamba, max_running_requests=2)
    run_checked(eng, reqs)
    for r in reqs:
        check_exact(eng, r)
        check_work(r)
    return eng, reqs


@presets
@grid
def test_pressure_evictions_tombstones_lost_checkpoints_stay_exact(make_engine, name, page):
    # FULL alone shares every page of the trunk: give it less room
    eng, reqs = _pressure(make_engine, name, page, seed=0, room=2 if name == "full-only" else 3)
    comps = eng.cache.stats()["components"]
    assert comps["full"]["evicted"] > 0, comps
    if has_kind(name, "S"):
        assert comps["swa"]["evicted"] > 0, comps
    if has_kind(name, "M"):
        assert comps["mamba"]["evicted"] > 0, comps  # checkpoints lost mid-run
    if page < 16 and name != "full-only":
        # internal SWA windows / checkpoints evicted while FULL stayed: tombstones
        assert sum(comps[c]["tombstones"] for c in ("swa", "mamba") if c in comps) > 0, comps
    assert sum(r.metrics.cached_tokens for r in reqs) > 0, "nothing reused under pressure"


@presets
@grid
def test_pressure_preemption_stays_exact(make_engine, name, page):
    """Three distinct prompts fit at admission, a fourth waits; the three cannot all
    grow with their outputs: the newest decoding request is preempted, goes back to the
    front of the queue (ahead of the one that never started), and resumes later."""
    rng = random.Random(5)
    L, out = 30, 8
    reqs = [greedy(toks(rng, L), out) for _ in range(4)]
    pages = 3 * -(-L // page) + 1
    eng = make_engine(name, page_size=page, max_total_tokens=pages * page, max_mamba_cache_size=8)
    for r in reqs:
        eng.submit(r)
    both = False
    while eng.waiting or eng.running:
        eng.step()
        check_ownership(eng)
        states = [s.owner.status for s in eng.waiting]
        assert set(states) <= {"waiting", "preempted"}, states
        # a preempted request re-queues at the front: never behind one that has not started
        assert states == sorted(states, key=lambda st: st != "preempted"), states
        both = both or {"waiting", "preempted"} <= set(states)
    assert both, "the test needs a preempted request and a waiting one queued together"
    assert eng.counters["preemptions"] > 0
    assert sum(r.metrics.preemptions for r in reqs) == eng.counters["preemptions"]
    assert reqs[0].metrics.preemptions == 0, "the oldest request was preempted, not the newest"
    for r in reqs:
        check_exact(eng, r)
        check_work(r)
        assert len(r.output_ids) == out and r.finish_reason == "length"


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if has_kind(n, "M") and not has_kind(n, "S")])
@pytest.mark.parametrize("page", [4, 16])
def test_preempted_work_is_cached_and_resumed(make_engine, name, page):
    """The preempted request's computed tokens go to the tree (not thrown away): when it
    comes back it resumes from a checkpoint it left, not from scratch. (Layouts where
    the split at its checkpoints leaves a small leaf, so the eviction that makes room
    for the other request does not take all of it; FULL evicts whole leaves.)"""
    rng = random.Random(7)
    L, out = 30, 6
    reqs = [greedy(toks(rng, L), out) for _ in range(2)]
    eng = make_engine(name, page_size=page, max_total_tokens=2 * -(-L // page) * page, max_mamba_cache_size=8)
    run_checked(eng, reqs)
    first, second = reqs
    assert first.metrics.preemptions == 0 and second.metrics.preemptions == 1
    assert second.metrics.cached_tokens == 0
    # from scratch it would compute its prompt and then prompt + outputs again
    assert L < second.metrics.computed_tokens < 2 * L, second.metrics
    for r in reqs:
        check_exact(eng, r)


@pytest.mark.slow
@presets
@grid
@pytest.mark.parametrize("seed", range(4))
def test_pressure_random(make_engine, name, page, seed):
    rng = random.Random(1000 + seed)
    _pressure(make_engine, name, page, seed=seed, trunk_len=rng.randrange(20, 100),
              branches=rng.randrange(5, 25), out=rng.randrange(1, 16), ratio=rng.choice([0.5, 1.0, 2.0]),
              mamba=rng.randrange(3, 12), room=rng.choice([2, 3, 5]))


# --------------------------------------------------------------------------- work and junctions
@presets
@grid
@pytest.mark.parametrize("aligned", [True, False])
def test_junction_keeps_what_the_next_branch_resumes_from(make_engine, name, page, aligned):
    """A = X; B = X[:k] + Y branches at k; C = X[:k] + Z then resumes at page_floor(k):
    B's junction left a checkpoint (M) and the window before it (S) there. B itself
    resumes lower where the layout has M layers (no checkpoint was kept at k), at
    page_floor(k) where it has none: FULL alone, or S layers, whose windows A's prompt
    left in the tree as spares (and lower with windows kept only at resume points)."""
    rng = random.Random(6)
    X = toks(rng, 40)
    k = {1: 22, 4: 22, 16: 22}[page]
    if aligned:
        k = page_floor(k, page) if page > 1 else 20
    pk = page_floor(k, page)
    A = greedy(X, 4)
    B = greedy(X[:k] + diverging(rng, 12, [X[k]]), 4)
    C = greedy(X[:k] + diverging(rng, 12, [X[k], B.input_ids[k]]), 4)
    eng = make_engine(name, page_size=page)
    for r in (A, B, C):
        eng.run([r])
        check_exact(eng, r)
        check_work(r)
        assert r.metrics.preemptions == 0
        assert r.metrics.computed_tokens == len(r.input_ids) - r.metrics.cached_tokens
    assert A.metrics.cached_tokens == 0
    if not has_kind(name, "M"):
        assert B.metrics.cached_tokens == pk
    else:
        assert B.metrics.cached_tokens < pk, "the test needs k past what A left reusable"
    assert C.metrics.cached_tokens == pk, (C.metrics, pk)
    assert C.metrics.computed_tokens == len(C.input_ids) - pk


@presets
@grid
def test_the_same_prompt_again_resumes_at_its_resume_point(make_engine, name, page):
    """A request that decodes far past its prompt still leaves its prompt resumable: the
    same prompt sent again (a regenerate) resumes at page_floor(len - 1), the deepest
    point a match of all but the last token can reach, with the recurrent checkpoint and
    the SWA window kept there, and is exact."""
    rng = random.Random(11)
    X = toks(rng, 37)
    eng = make_engine(name, page_size=page)
    first = greedy(X, 3 * 16 + 5)  # decodes well past the window and several pages
    eng.run([first])
    again = greedy(X, 4)
    eng.run([again])
    for r in (first, again):
        check_exact(eng, r)
        check_work(r)
    assert again.metrics.cached_tokens == page_floor(len(X) - 1, page)
