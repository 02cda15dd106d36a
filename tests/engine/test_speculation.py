"""Speculative decoding (engine/speculation.py): drafts verified several tokens a step
change nothing a client sees but speed. On every family preset, page sizes 1 / 4 / 16
and every tier, with in-batch sharing, chunked prefill and preemption: the same greedy
tokens and logits rows as speculation off, the same cached tokens per request, the same
hit rate, and the audit settles after every step. Drafts come from the real prompt
lookup, and from drafters that are always right (every draft kept: chunks crossing
pages and checkpoints, the length limit inside a chunk) or right then wrong (a rejection
at every position), so the rollback of every component is exercised whatever the
model's taste for repetition."""
from __future__ import annotations

import random

import pytest
import torch

from engine_checks import (PAGE_SIZES, PRESET_NAMES, Engine, GreedyDrafter, Request, SamplingParams, check_exact,
                           run_checked)
from uniradix.config import EngineConfig
from uniradix.engine.speculation import ROW_COST, draft_bar, Drafting, PromptLookup

SPEC = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)


def test_the_cache_drafts_what_followed_in_the_tenants_tree(make_engine):
    """SUFFIX drafts a reply from what the cache holds for the same salt: a request that
    continues a cached conversation part way through its reply verifies the rest of that
    reply as drafts and keeps them (greedy: the model says the same again); the same
    request from another tenant finds nothing to draft, and replies the same."""
    eng = make_engine("tiny-hybrid", page_size=4, speculative_algorithm="SUFFIX")
    prompt = [random.Random(3).randrange(3, 250) for _ in range(40)]
    first = Request(input_ids=prompt, salt="a", sampling=SamplingParams(max_new_tokens=30))
    eng.run([first])
    assert eng.counters["spec_verify_steps"] == 0  # the tree held nothing to draft from
    again = Request(input_ids=prompt + first.output_ids[:5], salt="a", sampling=SamplingParams(max_new_tokens=20))
    eng.run([again])
    assert again.output_ids == first.output_ids[5:25]
    assert eng.counters["spec_accepted_tokens"] >= 10
    kept, steps = eng.counters["spec_accepted_tokens"], eng.counters["spec_verify_steps"]
    other = Request(input_ids=prompt + first.output_ids[:5], salt="b", sampling=SamplingParams(max_new_tokens=20))
    eng.run([other])
    assert other.output_ids == again.output_ids
    assert (eng.counters["spec_verify_steps"], eng.counters["spec_accepted_tokens"]) == (steps, kept)


# --------------------------------------------------------------------------- drafts
def test_prompt_lookup_drafts_the_longest_match_newest_first():
    pl = PromptLookup(1, 4)
    t = [1, 2, 3, 9, 8, 2, 3, 7, 6, 1, 2, 3]
    # "1 2 3" occurred at 0 (then 9) and "2 3" at 5 (then 7): the longer match wins
    assert pl.propose(t, 4) == [9, 8, 2, 3]
    assert pl.propose(t, 2) == [9, 8]                       # k bounds it
    assert PromptLookup(1, 1).propose(t, 4) == [7, 6, 1, 2]  # one token of evidence: the newest
    assert pl.propose(t + [5], 4) == []                     # 5 never occurred before
    assert PromptLookup(1, 4).propose([4, 4], 3) == [4, 4, 4]  # a run into the end goes on repeating
    assert PromptLookup(2, 8).propose([9, 5, 6, 7, 5, 6, 7, 5], 5) == [6, 7, 5, 6, 7]
    assert PromptLookup(3, 4).propose([1, 2, 3, 1, 2], 4) == []  # fewer than min_n tokens match


def test_prompt_lookup_indexes_tokens_as_they_come():
    pl = PromptLookup(2, 6)
    t = [5, 6, 7, 8]
    assert pl.propose(t, 3) == []
    t += [5, 6]
    assert pl.propose(t, 3) == [7, 8, 5]
    assert pl.seen == len(t)
    t += [7, 9, 5, 6]   # now "5 6" was followed by 7 then... the newest occurrence with the longest match
    assert pl.propose(t, 2) == [7, 9]


def test_draft_length_follows_how_the_requests_drafts_went():
    d = Drafting(PromptLookup(1, 2))
    first = d.length(16)
    assert 1 <= first < 16                      # no record yet: a few
    assert d.length(2) == min(first, 2)         # never past k
    for _ in range(6):
        d.judged(first, first)                  # everything kept: longer each time
    assert d.length(16) == 16
    for _ in range(12):
        d.judged(8, 0)                          # nothing kept: one draft
    assert d.length(16) == 1
    # the rule itself: the d-th draft while a^d >= ROW_COST, a = kept / (kept + lost)
    for kept, lost in ((3.0, 1.0), (9.0, 1.0), (1.0, 4.0)):
        d.kept, d.lost = kept, lost
        a = kept / (kept + lost)
        want = max(1, max(n for n in range(0, 17) if a ** n >= ROW_COST))
        assert d.length(16) == min(16, want)


def test_a_batch_asks_more_of_a_draft_than_one_request_alone():
    bars = [draft_bar(n) for n in (0, 1, 2, 4, 16, 64)]
    assert bars[0] == bars[1] == ROW_COST                # alone: a row against a one-row step
    assert bars == sorted(bars) and bars[2] < bars[3] < bars[-1] < 1
    d = Drafting(PromptLookup(1, 2))
    d.kept, d.lost = 4.0, 1.0                            # a = 0.8
    assert d.length(16, draft_bar(1)) > d.length(16, draft_bar(8)) >= 1


def test_a_request_whose_drafts_fail_pauses_longer_each_time():
    d = Drafting(PromptLookup(1, 2))
    waits = []
    for _ in range(5):
        d.judged(4, 0)
        while d.rate >= 0.3 + 1e-9 and not d.wait:
            d.judged(4, 0)
        waits.append(d.wait)
        d.wait = 0
    assert waits == sorted(waits) and waits[-1] > waits[0] >= 1
    d.judged(4, 4)
    assert d.pause == 0  # good drafts again: the next pause starts short


def test_long_drafts_that_fail_late_shorten_and_never_pause():
    """Whether to draft is the first draft's question: verifies of 16 that keep one or two
    (an eighth of what they drafted) make the drafts shorter, not a pause."""
    d = Drafting(PromptLookup(1, 2))
    for i in range(40):
        d.judged(16, 1 + i % 2)
        assert d.wait == 0
    assert d.length(16) <= 4
    for _ in range(4):
        d.judged(2, 0)   # then the first draft fails again and again: a pause
    assert d.wait >= 1


# --------------------------------------------------------------------------- settings
def test_sglang_and_vllm_forms_and_what_needs_speculation():
    c = EngineConfig.of(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                           '"prompt_lookup_min": 2, "prompt_lookup_max": 5}').speculative
    assert (c.speculative_algorithm, c.speculative_num_draft_tokens) == ("NGRAM", 3)
    assert (c.speculative_ngram_min_match_window_size, c.speculative_ngram_max_match_window_size) == (2, 5)
    for bad, why in (('{"method": "eagle"}', "method"), ('{"method": "ngram", "draft_model": "x"}', "unsupported"),
                     ("[1]", "JSON object"), ("{", "not valid JSON")):
        with pytest.raises(ValueError, match=why):
            EngineConfig.of(speculative_config=bad)
    with pytest.raises(ValueError, match="disagree"):
        EngineConfig.of(speculative_num_draft_tokens=5, speculative_config='{"method": "ngram", '
                                                                          '"num_speculative_tokens": 3}')
    with pytest.raises(ValueError, match="min-match-window-size"):
        EngineConfig.of(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=5,
                        speculative_ngram_max_match_window_size=2)
    with pytest.raises(ValueError, match="no effect without speculative decoding"):
        Engine("tiny-hybrid", speculative_num_draft_tokens=3)
    with pytest.raises(ValueError, match="must be one of"):
        EngineConfig.of(speculative_algorithm="EAGLE")


# --------------------------------------------------------------------------- workloads
def conversations(seed: int, n: int = 4, rounds: int = 3, out: int = 14) -> list[list[Request]]:
    """`rounds` rounds of `n` conversations whose turns repeat what came before (a
    document quoted, a pattern continued): the prompt lookup finds drafts, and every
    later turn extends its conversation's earlier one (cache hits across rounds). One
    request in each round samples (temperature 0.8, seeded) and one asks for logprobs."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 250) for _ in range(rng.randrange(9, 20))] for _ in range(n)]
    history = [d * 3 + d[:5] for d in docs]
    out_rounds = []
    for r in range(rounds):
        reqs = []
        for i in range(n):
            kw = dict(temperature=0.8, seed=100 * r + i) if i == 1 else {}
            reqs.append(Request(input_ids=list(history[i]), record_logits=True, logprobs=3 if i == 2 else None,
                                sampling=SamplingParams(max_new_tokens=out, **kw)))
        out_rounds.append(reqs)
        for i in range(n):
            history[i] = history[i] + [rng.randrange(3, 250)] + docs[i][2:9]   # the next turn's new text
    return out_rounds


def serve(engine: Engine, rounds) -> list[list[Request]]:
    """Each round after the one before, the next round's prompts extending this one's
    prompt and reply (as a chat client sends them back)."""
    done = []
    for r, reqs in enumerate(rounds):
        if r:
            for req, prev in zip(reqs, done[-1]):
                req.input_ids = list(prev.input_ids) + list(prev.output_ids) + req.input_ids[len(prev.input_ids):]
        run_checked(engine, reqs)
        done.append(reqs)
    return done


def same_service(off: list[list[Request]], on: list[list[Request]], greedy_only: bool = False) -> None:
    for r, (a_round, b_round) in enumerate(zip(off, on)):
        for a, b in zip(a_round, b_round):
            assert b.status == a.status == "finished", (b.status, b.error)
            assert b.metrics.cached_tokens == a.metrics.cached_tokens, (r, a.metrics, b.metrics)
            assert b.metrics.host_tokens == a.metrics.host_tokens and b.metrics.storage_tokens == a.metrics.storage_tokens
            if a.sampling.temperature == 0:
                assert b.output_ids == a.output_ids, (r, a.rid)
                assert len(b.logits) == len(a.logits) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
                assert b.output_logprobs == a.output_logprobs
                assert b.finish_reason == a.finish_reason


class Oracle:
    """Drafts from the replies speculation off gave (`right` tokens of them), then
    wrong ones: k drafts, the first `right` kept by a greedy verify."""

    def __init__(self, engine: Engine, off_rounds, right):
        self.replies = {tuple(r.input_ids): r.output_ids for rnd in off_rounds for r in rnd}
        self.right, self.engine, self.calls = right, engine, 0

    def __call__(self, st) -> list[int]:
        req = st.owner
        reply = self.replies.get(tuple(req.input_ids))
        room = req.sampling.max_new_tokens - len(req.output_ids) - 1
        if reply is None or room <= 0 or req.sampling.temperature:
            return []
        self.calls += 1
        have = len(req.output_ids)
        k = min(4, room)
        right = self.right(self.calls) if callable(self.right) else self.right
        drafts = list(reply[have:have + min(right, k)])
        while len(drafts) < k:
            drafts.append((reply[have + len(drafts)] + 1) % 256 if have + len(drafts) < len(reply) else 7)
        return drafts


def tier_settings(tier: str, tmp_path) -> dict:
    if tier == "L1":
        return {}
    kw = dict(enable_hierarchical_cache=True, hicache_ratio=2.0)
    if tier == "L1+L2+L3":
        kw.update(hicache_storage_backend="file",
                  hicache_storage_backend_extra_config=f'{{"path": "{tmp_path}/l3", "prefetch_threshold": 4}}')
    return kw


def pair(make_engine, preset, page_size, tier, tmp_path, speculative_algorithm="NGRAM", **kw):
    base = dict(page_size=page_size, max_total_tokens=kw.pop("max_total_tokens", 1024), chunked_prefill_size=24,
                **tier_settings(tier, tmp_path), **kw)
    off = make_engine(preset, **base)
    if tier == "L1+L2+L3":
        (tmp_path / "on").mkdir()
        base.update(tier_settings(tier, tmp_path / "on"))
    on = make_engine(preset, **base, **{**SPEC, "speculative_algorithm": speculative_algorithm})
    return off, on


# --------------------------------------------------------------------------- every hit kept
@pytest.mark.parametrize("algorithm", ["NGRAM", "SUFFIX", "NGRAM+SUFFIX"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_real_drafts_change_nothing_but_steps(make_engine, preset, page_size, algorithm, tmp_path):
    """Prompt lookup, the cache's drafts (each turn's reply found in the turn before,
    cached) and both."""
    off, on = pair(make_engine, preset, page_size, "L1", tmp_path, speculative_algorithm=algorithm)
    a, b = serve(off, conversations(1)), serve(on, conversations(1))
    same_service(a, b)
    if algorithm != "SUFFIX":  # replies here seldom repeat earlier turns' text: the cache has little to draft
        assert on.counters["spec_verify_steps"] > 0 and on.counters["spec_draft_tokens"] > 0
    assert on.stats()["hit_rate"] == off.stats()["hit_rate"]
    for rnd in b:
        for req in rnd:
            if req.sampling.temperature == 0:
                check_exact(on, req)


@pytest.mark.parametrize("tier", ["L1", "L1+L2", "L1+L2+L3"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("preset", ["tiny-hybrid", "gemma3-like", "jamba-like"])
@pytest.mark.parametrize("right", [4, 2, 0], ids=["all kept", "two kept", "none kept"])
def test_every_hit_kept_whatever_is_accepted(make_engine, preset, page_size, tier, right, tmp_path):
    """Drafts that are right `right` times of 4, on every tier: the verify keeps and
    rolls back at every position, across pages and the decode checkpoint's moves."""
    off, on = pair(make_engine, preset, page_size, tier, tmp_path)
    a = serve(off, conversations(2))
    oracle = on._drafts = Oracle(on, a, right)
    b = serve(on, conversations(2))
    same_service(a, b)
    assert oracle.calls > 0
    kept = on.counters["spec_accepted_tokens"]
    assert kept == 0 if right == 0 else kept > 0
    assert on.stats()["hit_rate"] == off.stats()["hit_rate"]
    if tier != "L1":
        assert on.stats()["cache"]["host"]["loads"] == off.stats()["cache"]["host"]["loads"]


def shared_rounds(shared: list[int]):
    rounds = conversations(3, n=6, rounds=2, out=18)
    for rnd in rounds:
        for r in rnd:
            r.input_ids = shared + r.input_ids
    return rounds


@pytest.mark.parametrize("preset", ["tiny-hybrid", "qwen3-next-like"])
def test_preemption_and_in_batch_sharing_with_speculation(make_engine, preset, tmp_path):
    """Pools that cannot hold every request at once: requests are preempted between
    speculating steps and resume; requests that share a prefix compute it once. Drafts
    that are all rejected keep the schedule a step at a time would have (each verify keeps
    one token), so every admission sees the same tree: the same cached tokens, request by
    request, though every step verified drafts from the pages left free. Drafts that are
    kept make requests finish sooner, which moves later admissions: the replies stay the
    same and the audit settles."""
    # windows only at resume points: the shared prefixes reach the tree by in-batch sharing
    kw = dict(max_total_tokens=232, max_running_requests=6, max_mamba_cache_size=40, swa_retention="windows")
    rng = random.Random(5)
    shared = [rng.randrange(3, 250) for _ in range(48)]
    off, on = pair(make_engine, preset, 4, "L1", tmp_path, **kw)
    a = serve(off, shared_rounds(shared))
    on._drafts = Oracle(on, a, 0)
    b = serve(on, shared_rounds(shared))
    same_service(a, b)
    assert off.counters["preemptions"] == on.counters["preemptions"] > 0
    assert on.counters["shared_prefixes"] == off.counters["shared_prefixes"] > 0
    assert on.counters["spec_verify_steps"] > 0
    _, kept = pair(make_engine, preset, 4, "L1", tmp_path / "kept", **kw)
    kept._drafts = Oracle(kept, a, lambda i: i % 5)
    c = serve(kept, shared_rounds(shared))
    for x, y in zip(sum(a, []), sum(c, [])):
        if x.sampling.temperature == 0:
            assert y.output_ids == x.output_ids
    assert kept.counters["preemptions"] > 0 and kept.counters["spec_accepted_tokens"] > 0


def test_stops_and_the_length_cut_inside_a_chunk(make_engine):
    """A stop id, a stop string and max_new_tokens that fall on a kept draft end the
    reply there, as a step at a time would."""
    off = make_engine("tiny-hybrid", page_size=4)
    on = make_engine("tiny-hybrid", page_size=4, **SPEC)
    prompt = [random.Random(9).randrange(3, 250) for _ in range(30)]
    free = off.generate(prompt, max_new_tokens=12)
    stop_id = free.output_ids[6]
    text = off.tokenizer.decode(free.output_ids[4:7])
    cases = [dict(max_new_tokens=12, stop_ids=(stop_id,)), dict(max_new_tokens=12, stop=(text,)),
             dict(max_new_tokens=5)]
    a = [[Request(input_ids=prompt, sampling=SamplingParams(**kw)) for kw in cases]]
    serve(off, a)
    b = [[Request(input_ids=prompt, sampling=SamplingParams(**kw)) for kw in cases]]
    on._drafts = Oracle(on, [[Request(input_ids=prompt, sampling=SamplingParams(max_new_tokens=12))]], 4)
    on._drafts.replies = {tuple(prompt): free.output_ids}
    serve(on, b)
    for x, y in zip(a[0], b[0]):
        assert (y.output_ids, y.finish_reason, y.matched_stop) == (x.output_ids, x.finish_reason, x.matched_stop)
    assert on.counters["spec_accepted_tokens"] > 0


def test_drafts_shrink_to_the_room_the_free_handles_have(make_engine):
    """A recurrent model's verify needs a free state slot for every draft position (drafts
    never evict): where the pool has room for some of a step's drafts but not all, the
    step verifies the longest half that fits instead of none, and counts the cut in
    spec_no_room; the reply and every logits row are the ones speculation off gives."""
    prompt = [random.Random(9).randrange(3, 250) for _ in range(30)]
    replies = {}
    for slots, k in ((6, 8), (64, 8), (3, 8)):
        eng = make_engine("qwen3-next-like", page_size=4, speculative_algorithm="NGRAM",
                          speculative_num_draft_tokens=k, max_mamba_cache_size=slots)
        eng._drafts = GreedyDrafter(eng, k)
        asked_got, room_for = [], eng._room_for

        def watched(st, drafts):
            got = room_for(st, drafts)
            asked_got.append((len(drafts), len(got[0])))
            return got
        eng._room_for = watched
        r = Request(input_ids=prompt, sampling=SamplingParams(max_new_tokens=24), record_logits=True)
        eng.run([r])
        check_exact(eng, r)
        replies[slots] = (r.output_ids, dict(eng.counters), asked_got)
    (tight, cut), (roomy, whole), (none, _) = (replies[n][1:] for n in (6, 64, 3))
    assert replies[6][0] == replies[64][0] == replies[3][0]
    assert roomy["spec_no_room"] == 0 and all(a == g for a, g in whole)
    # cut, not dropped: the tight pool verified the drafts that fit
    assert tight["spec_no_room"] > 0 and any(0 < g < a for a, g in cut)
    assert tight["spec_accepted_tokens"] > 0 and all(g in (a, a // 2, a // 4, a // 8, 0) for a, g in cut)
    assert none["spec_verify_steps"] == 0 and none["spec_no_room"] > 0  # no free slot at all: no drafts


def test_a_steps_drafts_share_the_chunk_budget(make_engine):
    """A step verifies at most --chunked-prefill-size drafts in all, each decoding request
    at most an even share of what the ones before it left: four requests drafting 8 each
    would make 32 verify rows a step, a budget of 12 lets each draft 3; the replies and
    every logits row are still speculation off's."""
    prompts = [[random.Random(i).randrange(3, 250) for _ in range(3)] for i in range(4)]  # one step's prefill
    eng = make_engine("tiny-hybrid", page_size=4, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8,
                      chunked_prefill_size=12)
    eng._drafts = GreedyDrafter(eng, 8)
    add, steps = eng._add_drafts, []

    def watched(batch):
        out = add(batch)
        steps.append([len(inp.tokens) - 1 for st, inp in out if inp.start >= st.prompt_len])
        return out
    eng._add_drafts = watched
    reqs = [Request(input_ids=p, sampling=SamplingParams(max_new_tokens=24), record_logits=True) for p in prompts]
    eng.run(reqs)
    for r in reqs:
        check_exact(eng, r)
    assert steps and all(sum(s) <= 12 for s in steps)
    assert steps[1] == [3, 3, 3, 3]  # four decoding: 12 // 4 each
    assert eng.counters["spec_accepted_tokens"] > 0


def test_sessions_and_aborts_with_speculation(make_engine):
    on = make_engine("tiny-hybrid", page_size=4, **SPEC)
    prompt = [3, 4, 5, 6, 7] * 8
    r1 = Request(input_ids=prompt, session_id="s", sampling=SamplingParams(max_new_tokens=10))
    on.run([r1])
    r2 = Request(input_ids=prompt + r1.output_ids + [9, 3, 4], session_id="s", sampling=SamplingParams(max_new_tokens=10))
    r3 = Request(input_ids=prompt[:20] * 2, sampling=SamplingParams(max_new_tokens=30))
    on.submit(r2)
    on.submit(r3)
    for _ in range(6):
        on.step()
        on.audit()
    assert on.abort(r3)
    while on.running or on.waiting:
        on.step()
        on.audit()
    assert r2.metrics.cached_tokens >= len(prompt) - 4 and r3.status == "aborted"
    assert on.close_session("s")


@pytest.mark.parametrize("which", ["likeliest", "unlikely", "outside top-k"])
def test_the_accept_rule_draws_from_the_models_distribution(which):
    """accept_draft's token, over 20,000 draws on one row, follows the distribution a
    plain draw follows (temperature, top-k and top-p applied), whatever the draft: kept
    with the model's probability of it, else drawn with it taken out. A chi-square test
    on a fixed draw (no flakes); a rule that kept the draft 1.3x too often fails by far."""
    from uniradix.engine.sampling import accept_draft, distribution
    g = torch.Generator().manual_seed(0)
    row = torch.randn(50, generator=g) * 2
    params = SamplingParams(temperature=0.9, top_k=10, top_p=0.95)
    p = distribution(row, params)
    p = p / p.sum()
    order = p.argsort(descending=True)
    draft = {"likeliest": order[0], "unlikely": order[2], "outside top-k": order[20]}[which].item()
    n, counts, kept = 20_000, torch.zeros(50), 0
    for _ in range(n):
        tok, accepted = accept_draft(row, params, draft, g)
        counts[tok] += 1
        kept += accepted
        assert accepted == (tok == draft)
    assert abs(kept / n - p[draft].item()) < 0.02
    support = p > 0
    assert counts[~support].sum() == 0
    expected = p[support] * n
    chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
    assert chi2 < 40, chi2  # about 9 degrees of freedom: p < 1e-5 past 40


def test_sampled_replies_keep_their_distribution(make_engine):
    """Speculative sampling with deterministic drafts draws each token from the model's
    distribution: over 600 seeded requests, the second and third tokens' frequencies
    match speculation off's (a chi-square test on a fixed draw: no flakes). The drafts
    are the likeliest tokens after the actual first one (often kept, sometimes not), so a
    rule that kept them too often or too rarely shows."""
    from collections import Counter
    prompt = [11, 12, 13, 14] * 6
    params = dict(max_new_tokens=3, temperature=0.6, top_k=6)

    def run(engine, drafts=None):
        reqs = [Request(input_ids=prompt, sampling=SamplingParams(**params, seed=s)) for s in range(600)]
        if drafts is not None:
            engine._drafts = lambda st: drafts(st.owner.output_ids)
        engine.run(reqs)
        return [tuple(r.output_ids) for r in reqs]

    off = run(make_engine("tiny-hybrid", max_running_requests=64))
    on_engine = make_engine("tiny-hybrid", max_running_requests=64, **SPEC)
    ref = on_engine.model.reference
    likely = {}
    for first in {t[0] for t in off}:
        d1 = int(ref(prompt + [first])[-1].argmax())
        likely[first] = [d1, int(ref(prompt + [first, d1])[-1].argmax())]
    on = run(on_engine, lambda out: likely[out[0]][len(out) - 1:] if len(out) < 3 else [])
    kept, drafted = on_engine.counters["spec_accepted_tokens"], on_engine.counters["spec_draft_tokens"]
    assert 0.15 * drafted < kept < 0.9 * drafted
    for pos in (1, 2):
        a, b = Counter(t[:pos + 1] for t in off), Counter(t[:pos + 1] for t in on)
        cells = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
        chi2 = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in cells)
        assert chi2 < len(cells) + 4 * len(cells) ** 0.5 + 8, (pos, chi2, len(cells))
