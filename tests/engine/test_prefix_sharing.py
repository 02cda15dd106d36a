"""In-batch prefix sharing: requests that arrive together and share a prefix the cache
lacks compute it once. A follower waits (in its place in the queue, its batch slot
kept) while an earlier running request computes the shared part, which then goes into
the tree with the window and the checkpoint a resume there needs; a hold ends when the
leader finishes, is preempted or aborted; tenants never share; outputs stay exact."""
from __future__ import annotations

import random

import pytest

from engine_checks import (PRESET_NAMES, check_exact, check_ownership, check_work, diverging, greedy, has_kind,
                           page_floor, run_checked, toks)
from uniradix.engine.admission import MIN_SHARED_TOKENS

PRE = 200  # the shared preamble


@pytest.fixture
def make_engine(make_engine):
    """Engines that keep sliding-window KV only at resume points, so the shared prefix
    reaches the tree by in-batch sharing alone (with spare windows a leader's prompt
    goes into the tree chunk by chunk: test_with_spare_windows_followers_resume_from_
    the_leaders_chunks)."""
    return lambda *a, **kw: make_engine(*a, **{"swa_retention": "windows", **kw})


def _family(rng, n=4, pre=PRE, own=(23, 31, 40, 17), out=3):
    """n prompts opening with one preamble, each going its own way right after it."""
    trunk = toks(rng, pre)
    firsts: set[int] = set()
    reqs = []
    for i in range(n):
        tail = diverging(rng, own[i % len(own)], firsts)
        firsts.add(tail[0])
        reqs.append(greedy(trunk + tail, out))
    return trunk, reqs


def _serve_family(eng):
    """_family's requests served together, each exact; the leader computes its whole
    prompt. Returns (requests, followers, prompt tokens)."""
    _, reqs = _family(random.Random(1))
    run_checked(eng, reqs)
    for r in reqs:
        check_exact(eng, r)
        check_work(r)
    lead = reqs[0]
    assert lead.metrics.cached_tokens == 0 and lead.metrics.computed_tokens == len(lead.input_ids)
    return reqs, reqs[1:], sum(len(r.input_ids) for r in reqs)


def _step_checked(eng, steps=1):
    for _ in range(steps):
        eng.step()
        check_ownership(eng)


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("chunk", [256, 48])
def test_requests_submitted_together_compute_their_shared_preamble_once(make_engine, name, page, chunk):
    eng = make_engine(name, page_size=page, chunked_prefill_size=chunk)
    reqs, followers, prompts = _serve_family(eng)
    for r in followers:  # each resumes where the preamble ends: it computes its own part only
        assert r.metrics.cached_tokens == page_floor(PRE, page), (r.rid, r.metrics)
    assert sum(r.metrics.computed_tokens for r in reqs) == prompts - 3 * page_floor(PRE, page)
    assert eng.counters["shared_prefixes"] >= 1


@pytest.mark.parametrize("name", ["tiny-hybrid", "gemma3-like", "jamba-like", "full-only"])
@pytest.mark.parametrize("page", [1, 4])
def test_a_leader_aborted_mid_prefix_releases_its_followers(make_engine, name, page):
    eng = make_engine(name, page_size=page, chunked_prefill_size=32)
    _, reqs = _family(random.Random(2))
    for r in reqs:
        eng.submit(r)
    _step_checked(eng, 2)
    lead = reqs[0]
    assert [st.owner for st in eng.running] == [lead]
    assert [st.owner for st in eng.waiting] == reqs[1:] and eng.holding == 3  # held behind the leader
    assert all(r.status == "waiting" for r in reqs[1:])
    assert eng.abort(lead)
    _step_checked(eng)  # the next in line leads now; the others wait for it
    assert [st.owner for st in eng.running] == [reqs[1]]
    assert eng.holding == 2
    while eng.waiting or eng.running:
        _step_checked(eng)
    assert lead.status == "aborted"
    for r in reqs[1:]:
        check_exact(eng, r)
        check_work(r)
    assert reqs[1].metrics.cached_tokens == 0  # the aborted leader cached nothing
    assert [r.metrics.cached_tokens for r in reqs[2:]] == [page_floor(PRE, page)] * 2


def test_a_leader_that_finishes_releases_its_follower_at_once(make_engine):
    """A follower is held only behind a request that runs: a leader that leaves (here
    it finishes within the step that computes the preamble) releases it at once."""
    eng = make_engine("tiny-hybrid", page_size=4, chunked_prefill_size=64)
    rng = random.Random(3)
    trunk = toks(rng, 120)
    lead = greedy(trunk, 1)  # its prompt is the preamble: it is done when the preamble is
    follow = greedy(trunk + diverging(rng, 20, ()), 2)
    eng.submit(lead)
    eng.submit(follow)
    steps = 0
    while not lead.done:
        _step_checked(eng)
        steps += 1
        assert follow.status == "waiting"
    _step_checked(eng)
    assert follow.status == "running"
    run_checked(eng, [])
    check_exact(eng, lead)
    check_exact(eng, follow)
    assert follow.metrics.cached_tokens == len(trunk)


@pytest.mark.parametrize("name", ["tiny-hybrid", "qwen3-next-like", "gpt-oss-like"])
def test_nested_prefixes_are_each_computed_once(make_engine, name):
    """A+x, A+B+y, A+B+z, A+w: A is computed once, by the first; B once, by the second
    (the third waits for it once A is in the tree)."""
    eng = make_engine(name, page_size=4, chunked_prefill_size=64)
    rng = random.Random(4)
    a = toks(rng, 100)
    b = diverging(rng, 80, ())
    x, w = diverging(rng, 12, (b[0],)), diverging(rng, 9, (b[0],))
    while w[0] == x[0]:
        w = diverging(rng, 9, (b[0],))
    y = toks(rng, 15)
    z = diverging(rng, 11, (y[0],))
    reqs = [greedy(a + x, 3), greedy(a + b + y, 3), greedy(a + b + z, 3), greedy(a + w, 3)]
    run_checked(eng, reqs)
    for r in reqs:
        check_exact(eng, r)
        check_work(r)
    assert [r.metrics.cached_tokens for r in reqs] == [0, 100, 180, 100]


@pytest.mark.parametrize("name", ["full-only", "tiny-hybrid"])
def test_tenants_never_share(make_engine, name):
    eng = make_engine(name, page_size=4)
    rng = random.Random(5)
    _, reqs = _family(rng)
    for r, salt in zip(reqs, ("a", "b", "a", "b")):
        r.salt = salt
    run_checked(eng, reqs)
    for r in reqs:
        check_exact(eng, r)
    # each tenant's first request computes the preamble, its second reuses it
    assert [r.metrics.cached_tokens for r in reqs] == [0, 0, PRE, PRE]


def test_a_held_request_keeps_its_place_and_its_slot(make_engine):
    """max_running 2: the leader runs, its follower is held with its slot kept, so an
    unrelated request behind it waits, and the follower runs before it."""
    eng = make_engine("tiny-hybrid", page_size=1, max_running_requests=2, chunked_prefill_size=64)
    rng = random.Random(6)
    _, (lead, follow) = _family(rng, n=2)
    other = greedy(diverging(rng, 150, (lead.input_ids[0],)), 3)
    for r in (lead, follow, other):
        eng.submit(r)
    started = []
    while eng.waiting or eng.running:
        _step_checked(eng)
        started += [st.owner for st in eng.running if st.owner not in started]
    assert started == [lead, follow, other]
    assert follow.metrics.cached_tokens == PRE
    for r in (lead, follow, other):
        check_exact(eng, r)


def test_no_starvation_under_a_stream(make_engine):
    """A request arrives every step, each sharing the preamble (and every third its
    own tenant's). Every request is served; a hold lasts at most while the leader
    computes the preamble; those that arrive while it does reuse it."""
    chunk, pre = 40, 160
    eng = make_engine("tiny-hybrid", page_size=4, chunked_prefill_size=chunk, max_running_requests=16)
    rng = random.Random(7)
    trunk = toks(rng, pre)
    reqs, arrived, admitted = [], {}, {}
    step = 0
    while step < 200 and (len(reqs) < 24 or eng.waiting or eng.running):
        if len(reqs) < 24:
            r = greedy(trunk + toks(rng, 8 + len(reqs) % 5), 2 + len(reqs) % 3)
            r.salt = "other" if len(reqs) % 3 == 2 else None
            eng.submit(r)
            reqs.append(r)
            arrived[r.rid] = step
        _step_checked(eng)
        step += 1
        for st in eng.running:
            admitted.setdefault(st.owner.rid, step)
    assert all(r.status == "finished" for r in reqs), [r.status for r in reqs]
    lead_steps = -(-pre // chunk) + 1  # the leader's preamble, and the step that caches it
    for r in reqs:
        assert admitted[r.rid] - arrived[r.rid] <= lead_steps + 1, (r.rid, arrived[r.rid], admitted[r.rid])
        check_exact(eng, r)
        check_work(r)
    first_of_tenant = {reqs[0].rid, reqs[2].rid}
    for r in reqs:
        if r.rid not in first_of_tenant:
            assert r.metrics.cached_tokens >= page_floor(pre, 4), (r.rid, r.metrics)


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("page", [1, 4])
def test_the_same_prompt_sent_while_the_first_decodes_resumes_at_its_prompt_end(make_engine, name, page):
    """A leader already past the shared part puts it in the tree at once where it
    still holds what a resume needs (its prompt's resume point)."""
    eng = make_engine(name, page_size=page)
    rng = random.Random(8)
    prompt = toks(rng, 90)
    first = greedy(prompt, 12)
    eng.submit(first)
    _step_checked(eng, 3)
    assert first.status == "running" and len(first.output_ids) >= 2
    again = greedy(prompt, 4)
    eng.submit(again)
    run_checked(eng, [])
    for r in (first, again):
        check_exact(eng, r)
        check_work(r)
    assert again.metrics.cached_tokens == page_floor(len(prompt) - 1, page)
    assert again.output_ids == first.output_ids[:4]


def test_a_short_shared_prefix_is_not_worth_a_wait(make_engine):
    eng = make_engine("tiny-hybrid", page_size=1)
    rng = random.Random(9)
    _, reqs = _family(rng, pre=MIN_SHARED_TOKENS - 1)
    for r in reqs:
        eng.submit(r)
    _step_checked(eng)
    assert len(eng.running) == 4 and eng.holding == 0
    run_checked(eng, [])
    for r in reqs:
        check_exact(eng, r)


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if has_kind(n, "M")])
def test_no_checkpoint_slot_for_the_leader_means_no_wait(make_engine, name):
    """A follower resumes from a checkpoint the leader captures for it; with no slot
    for one, nobody waits, and all stays exact."""
    eng = make_engine(name, page_size=4, max_mamba_cache_size=4)
    _, reqs = _family(random.Random(10))
    run_checked(eng, reqs)
    for r in reqs:
        check_exact(eng, r)
        check_work(r)


@pytest.mark.parametrize("name", ["tiny-hybrid", "gemma3-like", "jamba-like"])
def test_sharing_under_memory_pressure_stays_exact(make_engine, name):
    """Pools that hold about two requests: admission waits, decoding preempts, the tree
    evicts; sharing still computes each preamble once per wave and stays exact."""
    eng = make_engine(name, page_size=4, max_total_tokens=700, chunked_prefill_size=64)
    rng = random.Random(11)
    reqs = []
    for _ in range(2):
        _, fam = _family(rng, n=3, out=20)
        reqs += fam
    run_checked(eng, reqs)
    for r in reqs:
        check_exact(eng, r)
        check_work(r)
    assert sum(r.metrics.cached_tokens for r in reqs) >= 2 * PRE


@pytest.mark.parametrize("name", ["tiny-hybrid", "gemma3-like"])
def test_sharing_with_the_host_and_storage_tiers(make_engine, name, tmp_path):
    from uniradix.hicache.backends.file import FileBackend
    store = FileBackend(str(tmp_path))
    kw = dict(page_size=4, chunked_prefill_size=64, prefetch_threshold=4)
    eng = make_engine(name, enable_hierarchical_cache=True, hicache_ratio=4.0, storage=store, **kw)
    rng = random.Random(12)
    trunk, reqs = _family(rng)
    run_checked(eng, reqs)
    assert [r.metrics.cached_tokens for r in reqs] == [0] + [PRE] * 3
    # a second engine over the same store: every request reads its prompt from L3 at once
    # (nobody waits for a request whose read brought the prefix: the store serves all)
    again = [greedy(list(r.input_ids), 3) for r in reqs]
    eng2 = make_engine(name, storage=store, hicache_storage_prefetch_policy="wait_complete", **kw)
    run_checked(eng2, again)
    for r in reqs + again:
        check_exact(eng if r in reqs else eng2, r)
        check_work(r)
    assert all(r.metrics.cached_tokens >= PRE for r in again)


@pytest.mark.parametrize("name", ["gemma3-like", "tiny-hybrid"])
@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("chunk", [256, 48])
def test_with_spare_windows_followers_resume_from_the_leaders_chunks(make_engine, name, page, chunk):
    """With spare windows (the default), a leader's prompt goes into the tree chunk by
    chunk: a follower resumes at the shared preamble's end, or where the leader's last
    chunk put it, when waiting for the rest would save it too little; outputs exact."""
    eng = make_engine(name, page_size=page, chunked_prefill_size=chunk, swa_retention="spare")
    reqs, followers, prompts = _serve_family(eng)
    for r in followers:
        gap = page_floor(PRE, page) - r.metrics.cached_tokens
        assert 0 <= gap < max(MIN_SHARED_TOKENS, page), (r.rid, r.metrics)
    assert sum(r.metrics.computed_tokens for r in reqs) == prompts - sum(r.metrics.cached_tokens for r in followers)
