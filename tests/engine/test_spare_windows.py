"""Spare windows end to end (design.md §3 Retention, `--swa-retention spare`, the default):
a prompt's window pages stay cached as it is computed, chunk by chunk, so a second
conversation about the same document resumes where it leaves the first, where keeping
windows only at resume points makes it start over; under a pool too small for them the
spares go first and every conversation still resumes each turn where it stopped;
recurrent hybrids keep windows at resume points alone. Outputs exact throughout."""
from __future__ import annotations

import random

import pytest

from engine_checks import (SPECULATE, check_exact, check_work, diverging, greedy, page_floor, run_checked, speculating,
                           swa_held, toks)
from uniradix.model import PRESETS

W = PRESETS["gemma3-like"].window


def _serve(eng, prompt, out=4):
    r = greedy(prompt, out)
    run_checked(eng, [r])
    check_exact(eng, r)
    check_work(r)
    return r


@pytest.mark.parametrize("retention", ["spare", "windows"])
@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("chunk", [16, 4096])
def test_a_second_question_about_a_document_resumes_after_it(make_engine, retention, page, chunk):
    eng = make_engine("gemma3-like", page_size=page, chunked_prefill_size=chunk, swa_retention=retention)
    rng = random.Random(3 + page)
    doc = toks(rng, 6 * W + 5)
    q1 = diverging(rng, 9, [])
    first = _serve(eng, doc + q1)
    _serve(eng, doc + q1 + first.output_ids + toks(rng, 7))  # the first conversation goes on
    second = _serve(eng, doc + diverging(rng, 9, [q1[0]]))  # another question about the document
    if retention == "spare":
        assert second.metrics.cached_tokens == page_floor(len(doc), page)
    else:  # the first kept windows at its prompt's end and its own end only
        assert second.metrics.cached_tokens < page_floor(len(doc), page) - W
    # and every page of the document's window stays: another branch anywhere resumes there
    k = page_floor(2 * W + 3, page)
    third = _serve(eng, doc[:k] + diverging(rng, 5, [doc[k]]))
    assert (third.metrics.cached_tokens == k) == (retention == "spare")


@pytest.mark.parametrize("page", [1, 4])
def test_spares_yield_to_every_conversations_next_turn(make_engine, page):
    """Three conversations taking turns on an SWA pool of a few windows, each prompt
    several times the pool: with spares or without, each turn resumes where its
    conversation stopped; with spares the requests hold no more of the pool."""
    runs = {}
    for retention in ("spare", "windows"):
        eng = make_engine("gemma3-like", page_size=page, chunked_prefill_size=8, max_total_tokens=512,
                          swa_full_tokens_ratio=0.04,
                          swa_retention=retention)
        assert eng.pools["swa"].size * page * 2 < 250
        rng = random.Random(60 + page)
        convs = [toks(rng, 250) for _ in range(3)]
        cached, held = [], []
        forward = eng.model.forward

        def recorded(*a, **kw):
            held.append(swa_held(eng))
            return forward(*a, **kw)

        eng.model.forward = recorded
        for turn in range(3):
            for i, prompt in enumerate(convs):
                r = _serve(eng, prompt, 5)
                if turn:
                    assert r.metrics.cached_tokens == page_floor(len(prompt) - 11, page), (retention, turn, i)
                cached.append(r.metrics.cached_tokens)
                convs[i] = prompt + r.output_ids + toks(rng, 10)
        runs[retention] = cached, max(held)
    assert runs["spare"][0] == runs["windows"][0]
    assert runs["spare"][1] <= runs["windows"][1]


def test_recurrent_hybrids_keep_windows_at_resume_points_alone(make_engine):
    """tiny-hybrid has sliding and recurrent layers: a window without a checkpoint beside
    it resumes nothing, so nothing is kept as a spare."""
    eng = make_engine("tiny-hybrid", page_size=1)
    assert not eng.cache.spare_windows
    rng = random.Random(9)
    doc = toks(rng, 5 * W)
    _serve(eng, doc + toks(rng, 6))
    swa = eng.cache.tree.index["swa"]
    stack = list(eng.cache.tree.root().children.values())
    while stack:
        nd = stack.pop()
        assert not nd.spare
        stack.extend(nd.children.values())
    assert eng.cache.tree.size[swa] < 3 * W


def test_a_pool_full_of_spares_leaves_a_verify_step_its_drafts(make_engine):
    """Spares never take the last share of their pool (cache.SPARE_RESERVE): drafts, which
    take free pages only (they never evict what is cached), still find room once earlier
    prompts have filled the window pool with spares."""
    eng = speculating(make_engine("gemma3-like", page_size=1, chunked_prefill_size=16, max_total_tokens=512,
                                  swa_full_tokens_ratio=0.25, **SPECULATE))
    swa, tree = eng.pools["swa"], eng.cache.tree
    reserve = eng.cache.ledger.spare_reserve[tree.index["swa"]]
    assert 0 < reserve < swa.size
    rng = random.Random(12)
    for _ in range(4):  # documents enough to fill the pool with spares
        _serve(eng, toks(rng, swa.size // 2), 2)
    assert tree.evictable("swa") > swa.size // 2 and swa.available >= reserve
    before = dict(eng.counters)
    r = _serve(eng, toks(rng, 40), 12)
    assert eng.counters["spec_verify_steps"] > before["spec_verify_steps"]
    assert eng.counters["spec_no_room"] == before["spec_no_room"], "a verify step found no room for its drafts"
    assert len(r.output_ids) == 12


@pytest.mark.parametrize("page", [1, 4])
def test_speculation_keeps_every_hit_when_spares_fill_the_pool(make_engine, page):
    """Questions about documents that outgrow a small window pool, one after another, with
    speculation off and on (drafts every step, partly right): every request caches the
    same tokens, the branches inside a document included, and the replies are the same."""
    kw = dict(page_size=page, chunked_prefill_size=16, max_total_tokens=1024, swa_full_tokens_ratio=0.15)
    off, on = make_engine("gemma3-like", **kw), speculating(make_engine("gemma3-like", **kw, **SPECULATE))
    rng = random.Random(70 + page)
    docs = [toks(rng, 90) for _ in range(4)]
    plan = [(d, q) for q in range(3) for d in (0, 1, 2, 3, 1, 0)]
    prompts = [docs[d] + [3 + q] + toks(rng, 6) for d, q in plan]
    cached = {}
    for name, eng in (("off", off), ("on", on)):
        reqs = [greedy(p, 8) for p in prompts]
        for r in reqs:
            run_checked(eng, [r])
            check_exact(eng, r)
        cached[name] = [r.metrics.cached_tokens for r in reqs], [r.output_ids for r in reqs]
        assert eng.cache.tree.evicted[eng.cache.tree.index["swa"]] > 0, "the pool never filled"
    assert cached["on"] == cached["off"]
    assert sum(c >= page_floor(90, page) for c in cached["off"][0]) > len(prompts) // 3  # branches resumed
    assert on.counters["spec_verify_steps"] > 0


def test_an_aborted_prompt_leaves_the_chunks_it_computed(make_engine):
    """A request aborted part way through its prompt gives back all it holds, and the
    chunks it already put in the tree stay there: the same prompt again resumes after
    them (and the audit settles)."""
    eng = make_engine("gemma3-like", page_size=4, chunked_prefill_size=16)
    rng = random.Random(21)
    prompt = toks(rng, 6 * W)
    first = greedy(prompt, 4)
    eng.submit(first)
    while eng.running or eng.waiting:
        eng.step()
        st = next((s for s in eng.running if s.owner is first), None)
        if st is not None and st.computed >= 3 * W:
            break
    done = page_floor(st.computed, 4)
    assert eng.abort(first) and first.status == "aborted"
    again = _serve(eng, prompt)
    assert again.metrics.cached_tokens >= done
