"""Engine behaviour: admission control, validation, stop ids, sampling, metrics, the
cache switched off, sessions, text input, SWA pages freed while decoding, and locks.
Every engine made through `make_engine` is checked for leaks and flushed when its test
ends (conftest)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from engine_checks import (PAGE_SIZES, PRESET_NAMES, Engine, Request, SamplingParams, check_exact,
                           check_flush, check_ownership, check_settled, check_work, diverging, greedy,
                           has_kind, page_floor, run_checked, swa_held, toks, tree_nodes)
from uniradix.engine import sample
from uniradix.model import PRESETS


def sampled(ids, n, **kw) -> Request:
    return Request(input_ids=list(ids), sampling=SamplingParams(max_new_tokens=n, **kw), record_logits=True)


# --------------------------------------------------------------------------- admission control
@pytest.mark.parametrize("name", ["tiny-hybrid", "full-only", "gemma3-like"])
@pytest.mark.parametrize("page", [1, 16])
def test_request_that_can_never_fit_fails_and_others_are_served(make_engine, name, page):
    eng = make_engine(name, page_size=page, max_total_tokens=64)
    rng = random.Random(10)
    ok1 = greedy(toks(rng, 20), 4)
    big = greedy(toks(rng, 70), 4)          # more prompt than the FULL pool holds
    long_out = greedy(toks(rng, 10), 60)    # fits as a prompt, not with its outputs
    ok2 = greedy(toks(rng, 25), 4)
    eng.submit(big)
    assert big.status == "error", "known at submission: it fails at once"
    eng.run([ok1, big, long_out, ok2])
    for bad in (big, long_out):
        assert bad.status == "error" and bad.done
        assert bad.finish_reason == "error"
        assert "can never fit" in bad.error and "full" in bad.error, bad.error
        assert bad.output_ids == [] and bad.logits == []
        assert bad.metrics.finished is not None
    for good in (ok1, ok2):
        check_exact(eng, good)
        check_work(good)
    assert eng.counters["errors"] == 2
    assert eng.counters["finished"] == 2
    # and it keeps serving afterwards
    later = greedy(toks(rng, 30), 3)
    eng.run([later])
    check_exact(eng, later)


def test_request_larger_than_the_swa_pool_fails_with_a_clear_message(make_engine):
    # the budget, 64 pages in each of 6 KV layers, split 43:1: FULL 344 pages, SWA 8
    eng = make_engine("gemma3-like", page_size=4, max_total_tokens=256, swa_full_tokens_ratio=1 / 43)
    assert eng.pools["swa"].size == 8 and eng.pools["full"].size == 344
    rng = random.Random(11)
    big = greedy(toks(rng, 60), 4)   # decoding, it holds two windows and a page: 11 SWA pages; the pool holds 8
    small = greedy(toks(rng, 20), 4)
    eng.submit(big)
    assert big.status == "error" and big.done, "known at submission: it fails at once"
    assert not eng.waiting
    eng.run([big, small])
    assert big.status == "error"
    assert "swa" in big.error and "can never fit" in big.error, big.error
    check_exact(eng, small)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_requests_wait_while_the_pools_are_full_and_all_complete(make_engine, name):
    rng = random.Random(12)
    reqs = [greedy(toks(rng, 30), 5) for _ in range(6)]
    # the pool holds about two of them at a time; nothing is shared
    eng = make_engine(name, page_size=4, max_total_tokens=80, max_mamba_cache_size=6)
    seen = run_checked(eng, reqs)
    assert seen["max_waiting"] > 0 and seen["max_running"] >= 1
    assert seen["max_running"] < len(reqs), "the pools were never the limit"
    for r in reqs:
        check_exact(eng, r)
        check_work(r)
    assert eng.counters["errors"] == 0
    assert eng.counters["finished"] == len(reqs)


def test_max_running_requests_is_respected(make_engine):
    eng = make_engine("tiny-hybrid", max_running_requests=2)
    rng = random.Random(13)
    reqs = [greedy(toks(rng, 12), 4) for _ in range(5)]
    for r in reqs:
        eng.submit(r)
    while eng.waiting or eng.running:
        eng.step()
        assert len(eng.running) <= 2
    for r in reqs:
        check_exact(eng, r)


@pytest.mark.parametrize("name", ["tiny-hybrid", "jamba-like", "gemma3-like", "full-only"])
def test_nothing_a_running_request_holds_is_evicted(make_engine, name):
    """A long request locks a cached prefix; a flood of other traffic through small
    pools evicts around it, never what it reads (checked every step), and its output
    stays exact. After the run no lock is left and a flush gives everything back."""
    rng = random.Random(14)
    shared = toks(rng, 24)
    eng = make_engine(name, page_size=4, max_total_tokens=160, max_mamba_cache_size=8)
    first = greedy(shared + toks(rng, 4), 2)
    eng.run([first])
    long = greedy(first.input_ids + first.output_ids + toks(rng, 6), 24)  # resumes at 28
    eng.submit(long)
    eng.step()
    assert long.metrics.cached_tokens == 28
    assert any(any(nd.locks) for nd in tree_nodes(eng.cache.tree))
    assert eng.cache.flush() is False, "flush must be refused while a request holds locks"
    flood = [greedy(toks(rng, 28), 3) for _ in range(6)]
    run_checked(eng, flood)   # ownership (incl. what `long` reads from the tree) every step
    assert eng.cache.stats()["components"]["full"]["evicted"] > 0
    check_exact(eng, long)
    for r in flood:
        check_exact(eng, r)
    check_settled(eng)
    check_flush(eng)


# --------------------------------------------------------------------------- validation
def test_input_validation(make_engine):
    eng = make_engine("tiny-hybrid")
    V = eng.cfg.vocab_size
    bad = [
        Request(input_ids=[]),
        Request(text=""),
        Request(input_ids=[1, 2, V]),
        Request(input_ids=[-1, 3]),
        Request(),                                   # neither
        Request(input_ids=[1, 2], text="ab"),         # both
    ]
    for r in bad:
        with pytest.raises(ValueError):
            eng.submit(r)
        assert not eng.waiting and not eng.running
    with pytest.raises(ValueError):
        eng.run([Request(input_ids=[300])])
    ok = greedy([1, 2, 3], 2)
    eng.run([ok])
    check_exact(eng, ok)
    with pytest.raises(ValueError):  # a request goes in once
        eng.submit(ok)
    assert eng.counters["errors"] == 0


@pytest.mark.parametrize("kw", [dict(max_new_tokens=0), dict(max_new_tokens=-3), dict(temperature=-0.1),
                                dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-1)])
def test_bad_sampling_params_raise(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw", [dict(chunked_prefill_size=0), dict(max_running_requests=0), dict(page_size=0),
                                dict(page_size=16, max_total_tokens=8), dict(swa_full_tokens_ratio=0),
                                dict(max_mamba_cache_size=0)])
def test_bad_engine_flags_raise(kw):
    with pytest.raises(ValueError):
        Engine("tiny-hybrid", **kw)


def test_unknown_preset_raises():
    with pytest.raises(ValueError, match="unknown preset"):
        Engine("no-such-model")


# --------------------------------------------------------------------------- stop ids, sampling
@pytest.mark.parametrize("name", ["tiny-hybrid", "jamba-like"])
def test_stop_ids_end_the_request(make_engine, name):
    eng = make_engine(name, page_size=4)
    rng = random.Random(15)
    prompt = toks(rng, 22)
    plain = greedy(prompt, 8)
    eng.run([plain])
    assert plain.finish_reason == "length" and len(plain.output_ids) == 8
    for i in (0, 3):
        stop = plain.output_ids[i]
        j = plain.output_ids.index(stop)
        req = greedy(prompt, 8, stop_ids=(stop, 255 if stop != 255 else 254))
        eng.run([req])
        assert req.finish_reason == "stop"
        assert req.status == "finished"
        assert req.output_ids == plain.output_ids[:j + 1]  # the stop token is kept
        assert req.metrics.output_tokens == j + 1
        check_exact(eng, req)


def test_seeded_sampling_is_repeatable_and_seeds_differ(make_engine):
    eng = make_engine("tiny-hybrid")
    rng = random.Random(16)
    prompt = toks(rng, 20)
    runs = {}
    for seed in range(4):
        r = sampled(prompt, 8, temperature=1.0, seed=seed)
        eng.run([r])
        check_exact(eng, r)
        runs[seed] = r.output_ids
    again = sampled(prompt, 8, temperature=1.0, seed=2)
    other = make_engine("tiny-hybrid", disable_radix_cache=True)
    fresh = sampled(prompt, 8, temperature=1.0, seed=2)
    eng.run([again])
    other.run([fresh])
    assert again.output_ids == runs[2]
    assert fresh.output_ids == runs[2]
    assert len({tuple(v) for v in runs.values()}) > 1, "different seeds never differed"
    g = greedy(prompt, 8)
    eng.run([g])
    assert any(v != g.output_ids for v in runs.values()), "temperature 1 sampled only the argmax"


def test_seeded_sampling_does_not_depend_on_the_batch(make_engine):
    """Each request draws from its own generator: the same seeds give the same tokens
    alone and inside a concurrent batch."""
    rng = random.Random(17)
    prompts = [toks(rng, 15 + 3 * i) for i in range(4)]
    alone = []
    for i, p in enumerate(prompts):
        eng = make_engine("tiny-hybrid", disable_radix_cache=True)
        r = sampled(p, 6, temperature=0.8, top_p=0.9, seed=40 + i)
        eng.run([r])
        alone.append(r.output_ids)
    eng = make_engine("tiny-hybrid")
    batch = [sampled(p, 6, temperature=0.8, top_p=0.9, seed=40 + i) for i, p in enumerate(prompts)]
    seen = run_checked(eng, batch)
    assert seen["max_running"] > 1
    assert [r.output_ids for r in batch] == alone
    for r in batch:
        check_exact(eng, r)


def test_tiny_top_p_is_greedy(make_engine):
    eng = make_engine("gpt-oss-like")
    rng = random.Random(18)
    prompt = toks(rng, 25)
    g = greedy(prompt, 8)
    t = sampled(prompt, 8, temperature=1.5, top_p=1e-9, seed=123)
    u = sampled(prompt, 8, temperature=1.5, top_p=1e-9)  # no seed: still only one candidate
    eng.run([g, t, u])
    assert t.output_ids == g.output_ids == u.output_ids
    check_exact(eng, g)
    check_exact(eng, t)


def test_top_p_keeps_the_smallest_set_reaching_p():
    """Probabilities 0.5, 0.3, 0.2: top_p 0.6 keeps the first two (the mass before the
    second, 0.5, is short of 0.6), renormalised to 5/8 and 3/8; the third never comes."""
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    gen = torch.Generator().manual_seed(0)
    n = 4000
    draws = [sample(logits, SamplingParams(temperature=1.0, top_p=0.6), gen) for _ in range(n)]
    counts = [draws.count(t) for t in range(3)]
    assert counts[0] == 0
    assert abs(counts[1] / n - 5 / 8) < 0.03 and abs(counts[2] / n - 3 / 8) < 0.03, counts
    only = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), gen) for _ in range(200)}
    assert only == {1}  # 0.5 reaches 0.5: the top token alone


def test_temperature_scales_the_distribution():
    logits = torch.tensor([0.0, math.log(2.0)])  # probabilities 1/3, 2/3 at temperature 1
    n = 4000
    for temp, want in ((1.0, 2 / 3), (0.5, 4 / 5), (4.0, 2 ** 0.25 / (1 + 2 ** 0.25))):
        gen = torch.Generator().manual_seed(1)
        ones = sum(sample(logits, SamplingParams(temperature=temp), gen) for _ in range(n))
        assert abs(ones / n - want) < 0.03, (temp, ones / n, want)
    assert sample(logits, SamplingParams(temperature=0.0), None) == 1


# --------------------------------------------------------------------------- metrics
def test_metrics_are_consistent(make_engine):
    eng = make_engine("tiny-hybrid", page_size=4)
    rng = random.Random(19)
    trunk = toks(rng, 30)
    first = greedy(trunk, 5)
    eng.run([first])
    reqs = [greedy(trunk[:k] + diverging(rng, 6, [trunk[k]]), 4) for k in (8, 17, 26)]
    reqs.append(greedy(trunk + first.output_ids + toks(rng, 3), 6))
    eng.run(reqs)
    everyone = [first] + reqs
    for r in everyone:
        m = r.metrics
        assert m.ttft is not None and m.latency is not None
        assert 0 < m.ttft <= m.latency
        assert m.arrival <= m.first_token <= m.finished
        assert m.prompt_tokens == len(r.input_ids)
        assert m.output_tokens == len(r.output_ids) == r.sampling.max_new_tokens
        assert m.cached_tokens + m.computed_tokens == m.prompt_tokens  # nothing was preempted
        assert m.preemptions == 0
        assert m.cached_tokens % 4 == 0
        check_exact(eng, r)
    assert reqs[-1].metrics.cached_tokens == page_floor(len(trunk) + 4, 4)
    st = eng.stats()
    assert st["finished"] == len(everyone) and st["errors"] == 0
    assert st["prompt_tokens"] == sum(r.metrics.prompt_tokens for r in everyone)
    assert st["cached_tokens"] == sum(r.metrics.cached_tokens for r in everyone)
    assert st["prefill_tokens"] == sum(r.metrics.computed_tokens for r in everyone)
    assert st["decode_tokens"] == sum(len(r.output_ids) - 1 for r in everyone)
    assert st["hit_rate"] == pytest.approx(st["cached_tokens"] / st["prompt_tokens"])
    assert st["waiting"] == 0 and st["running"] == 0
    assert st["cache"]["requests"] == len(everyone)


def test_unfinished_requests_have_no_latency():
    r = Request(input_ids=[1, 2, 3])
    assert r.metrics.ttft is None and r.metrics.latency is None
    assert r.status == "new" and not r.done


# --------------------------------------------------------------------------- cache off
@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("page", [1, 4])
def test_disable_radix_cache_matches_the_cached_engine(make_engine, name, page):
    rng = random.Random(20)
    trunk = toks(rng, 28)

    def workload():
        r = random.Random(21)
        first = [greedy(trunk, 4)]
        branches = [greedy(trunk[:k] + diverging(r, 5, [trunk[k]]), 4) for k in (9, 16, 20)]
        return first, branches

    outs = {}
    for off in (False, True):
        eng = make_engine(name, page_size=page, disable_radix_cache=off)
        first, branches = workload()
        eng.run(first)
        eng.run(branches)
        follow = greedy(trunk + first[0].output_ids + [7, 8, 9], 4)
        eng.run([follow])
        everyone = first + branches + [follow]
        for r in everyone:
            check_exact(eng, r)
            check_work(r)
        cached = [r.metrics.cached_tokens for r in everyone]
        if off:
            assert cached == [0] * len(everyone)
            assert eng.cache.tree.num_nodes == 0
            for pool in eng.pools.values():
                assert pool.available == pool.size
        else:
            assert sum(cached) > 0
        outs[off] = [r.output_ids for r in everyone]
    assert outs[True] == outs[False]


def test_disable_radix_cache_under_preemption(make_engine):
    rng = random.Random(22)
    reqs = [greedy(toks(rng, 30), 8) for _ in range(3)]
    eng = make_engine("tiny-hybrid", page_size=4, max_total_tokens=4 * 25, disable_radix_cache=True)
    run_checked(eng, reqs)
    assert eng.counters["preemptions"] > 0
    for r in reqs:
        assert r.metrics.cached_tokens == 0
        check_exact(eng, r)


# --------------------------------------------------------------------------- sessions
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_session_keeps_the_conversation_through_pressure(make_engine, name):
    """A finished turn of a session stays referenced: under pressure, unreferenced
    entries go first and the next turn still resumes at the end of the last one. The
    same traffic without a session loses it. close_session drops the reference."""
    page = 4
    hits = {}
    for sid in ("chat-1", None):
        eng = make_engine(name, page_size=page, max_total_tokens=100)
        rng = random.Random(23)
        a = greedy(toks(rng, 30), 4)
        a.session_id = sid
        b = greedy(toks(rng, 30), 4)
        eng.run([a])
        eng.run([b])
        if sid is not None:
            assert eng.stats()["cache"]["sessions"] == 1
        flood = greedy(toks(rng, 40), 4)      # needs room: something must go
        eng.run([flood])
        a2 = greedy(a.input_ids + a.output_ids + toks(rng, 5), 4)
        a2.session_id = sid
        eng.run([a2])
        for r in (a, b, flood, a2):
            check_exact(eng, r)
        hits[sid] = a2.metrics.cached_tokens
        if sid is not None:
            assert eng.close_session(sid) is True
            assert eng.close_session(sid) is False
            assert eng.stats()["cache"]["sessions"] == 0
            assert all(not any(nd.refs) for nd in tree_nodes(eng.cache.tree))
        else:
            assert eng.close_session("chat-1") is False
    assert hits["chat-1"] == page_floor(30 + 4 - 1, page)
    assert hits[None] < hits["chat-1"]


# --------------------------------------------------------------------------- text input
def test_text_input_goes_through_the_byte_tokenizer(make_engine):
    eng = make_engine("tiny-hybrid")
    text = "The cache is exact. Ünïcödé ✓"
    r = Request(text=text, sampling=SamplingParams(max_new_tokens=5), record_logits=True)
    eng.run([r])
    assert r.input_ids == list(text.encode("utf-8"))
    assert r.metrics.prompt_tokens == len(text.encode("utf-8"))
    check_exact(eng, r)
    assert isinstance(eng.tokenizer.decode(r.output_ids), str)
    g = eng.generate(text=text, max_new_tokens=5)
    assert g.input_ids == r.input_ids and g.output_ids == r.output_ids


def test_a_tokenizer_past_the_vocabulary_is_refused_at_submit(make_engine):
    """Text tokenized into ids the model has no embedding for (a checkpoint whose
    tokenizer does not match its config) is a ValueError at submit, never a failure
    inside a step."""
    eng = make_engine("tiny-hybrid")
    V = eng.model.vocab_size

    class Wide:
        def encode(self, text):
            return [5, V, V + 7, 6]

    eng.tokenizer = Wide()
    with pytest.raises(ValueError, match=rf"token ids \[{V}, {V + 7}\] past the model's vocabulary of {V}"):
        eng.submit(Request(text="hello", sampling=SamplingParams(max_new_tokens=2)))
    assert not eng.waiting and not eng.running


def test_text_prompts_share_prefixes(make_engine):
    eng = make_engine("full-only", page_size=4)
    system = "You are a helpful assistant. Answer briefly.\n"
    a = Request(text=system + "Q: what is a radix tree?", sampling=SamplingParams(max_new_tokens=3),
                record_logits=True)
    b = Request(text=system + "Q: why page sizes?", sampling=SamplingParams(max_new_tokens=3),
                record_logits=True)
    eng.run([a])
    eng.run([b])
    shared = len(system.encode()) + len("Q: wh")
    assert b.metrics.cached_tokens == page_floor(shared, 4)
    for r in (a, b):
        check_exact(eng, r)


def test_generate_convenience(make_engine):
    eng = make_engine("full-only")
    r = eng.generate(input_ids=[5, 6, 7, 8], max_new_tokens=3)
    assert r.status == "finished" and len(r.output_ids) == 3


# --------------------------------------------------------------------------- SWA while decoding
@pytest.mark.parametrize("page", [1, 4])
def test_swa_pages_are_freed_while_decoding(make_engine, page):
    """gemma3-like with a 4-token window: the FULL pool use grows with every token,
    SWA stays at about two windows (the one decoding reads and the one kept at the
    prompt's resume point) plus a page, however long the request decodes."""
    cfg = PRESETS["gemma3-like"].with_(window=4)
    eng = make_engine(cfg, page_size=page)
    rng = random.Random(24)
    L, out = 24, 30
    req = greedy(toks(rng, L), out)
    eng.submit(req)
    full, swa = eng.pools["full"], eng.pools["swa"]
    bound = 2 * -(-cfg.window // page) + 2
    used = []
    while eng.running or eng.waiting:
        eng.step()
        check_ownership(eng)
        if eng.running:
            used.append((full.size - full.available, swa_held(eng)))
    assert used[0][1] <= bound < -(-L // page), used[0]   # freed right after prefill
    assert all(s <= bound for _, s in used), used
    assert used[-1][0] > used[0][0] + 20 // page - 1      # FULL kept growing
    check_exact(eng, req)


# --------------------------------------------------------------------------- misc scheduling
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_tiny_prefill_chunks_are_exact(make_engine, name):
    eng = make_engine(name, page_size=4, chunked_prefill_size=3)
    rng = random.Random(25)
    trunk = toks(rng, 26)
    a = greedy(trunk, 4)
    eng.run([a])
    b = greedy(trunk[:18] + toks(rng, 9), 4)
    c = greedy(trunk + a.output_ids + toks(rng, 5), 4)
    run_checked(eng, [b, c])
    for r in (a, b, c):
        check_exact(eng, r)
        check_work(r)


@pytest.mark.parametrize("name", ["full-only", "jamba-like"])
def test_salt_isolates_caches(make_engine, name):
    eng = make_engine(name, page_size=4)
    rng = random.Random(26)
    p = toks(rng, 30)
    a = greedy(p, 3)
    a.salt = "tenant-a"
    b = greedy(p, 3)
    b.salt = "tenant-b"
    c = greedy(p, 3)
    c.salt = "tenant-a"
    eng.run([a])
    eng.run([b])
    eng.run([c])
    assert a.metrics.cached_tokens == 0 and b.metrics.cached_tokens == 0
    assert c.metrics.cached_tokens == page_floor(29, 4)
    assert a.output_ids == b.output_ids == c.output_ids
    for r in (a, b, c):
        check_exact(eng, r)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_a_one_token_request_caches_its_whole_prompt(make_engine, name):
    """max_new_tokens=1 finishes right after prefill: every prompt token was computed
    and the tree gets all of them (page-aligned prompt), so the next turn resumes at its end."""
    eng = make_engine(name, page_size=4)
    rng = random.Random(27)
    a = greedy(toks(rng, 24), 1)
    eng.run([a])
    b = greedy(a.input_ids + a.output_ids + toks(rng, 5), 3)
    eng.run([b])
    assert b.metrics.cached_tokens == 24
    for r in (a, b):
        check_exact(eng, r)
        check_work(r)


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if has_kind(n, "M")])
@pytest.mark.parametrize("page", PAGE_SIZES)
def test_state_pool_too_small_for_checkpoints_stays_exact(make_engine, name, page):
    """Two state slots: a running request's own state and at most one checkpoint. The
    rest are skipped (counted), the tree resumes only where a checkpoint really is, and
    a state that is not at a page end never poses as one."""
    eng = make_engine(name, page_size=page, max_mamba_cache_size=2)
    rng = random.Random(8)
    prompt = toks(rng, 30)
    for _ in range(3):
        r = greedy(prompt, 4)
        eng.run([r])
        check_exact(eng, r)
        check_work(r)
        prompt = prompt + r.output_ids + toks(rng, 6)
    assert eng.counters["checkpoints_skipped"] > 0


def test_single_token_prompt_and_single_output(make_engine):
    eng = make_engine("tiny-hybrid", page_size=16)
    a = greedy([42], 1)
    b = greedy([42], 3)
    eng.run([a, b])
    assert a.output_ids == b.output_ids[:1]
    for r in (a, b):
        check_exact(eng, r)
        assert r.metrics.cached_tokens == 0 and r.metrics.computed_tokens == 1
