"""Output log probabilities: each output token's log-probability under the model's raw
distribution at its step, and the k likeliest tokens with theirs. They come from the
same logits as the token, so reuse from the cache gives what the cache-off engine
gives, within the tolerance the logits themselves keep (engine_checks.TOL), sampled
or greedy."""
from __future__ import annotations

import math
import random

import pytest
import torch
from engine_checks import TOL, greedy, run_checked, toks

from uniradix.engine import Request, SamplingParams


def _turns(rng, eng, logprobs, **sampling):
    """Two turns of one conversation and a sibling branch; the requests in order."""
    first = toks(rng, 40)
    a = Request(input_ids=first, sampling=SamplingParams(max_new_tokens=6, **sampling), logprobs=logprobs,
                record_logits=True)
    run_checked(eng, [a])
    b = Request(input_ids=first + a.output_ids + toks(rng, 7), logprobs=logprobs, record_logits=True,
                sampling=SamplingParams(max_new_tokens=5, **sampling))
    c = Request(input_ids=first + toks(rng, 9), logprobs=logprobs, record_logits=True,
                sampling=SamplingParams(max_new_tokens=5, **sampling))
    run_checked(eng, [b, c])
    return [a, b, c]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}])
def test_logprobs_equal_the_cache_off_engine(make_engine, page_size, sampling):
    on = make_engine(page_size=page_size, max_total_tokens=1024)
    off = make_engine(page_size=page_size, max_total_tokens=1024, disable_radix_cache=True)
    got = _turns(random.Random(3), on, 3, **sampling)
    want = _turns(random.Random(3), off, 3, **sampling)
    assert got[1].metrics.cached_tokens > 0 and got[2].metrics.cached_tokens > 0
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        for (lg, tg), (lw, tw) in zip(g.output_logprobs, w.output_logprobs):
            assert lg == pytest.approx(lw, abs=TOL) and [t for t, _ in tg] == [t for t, _ in tw]
            assert [x for _, x in tg] == pytest.approx([x for _, x in tw], abs=TOL)
        assert len(g.output_logprobs) == len(g.output_ids)
        for tok, logits, (lp, top) in zip(g.output_ids, g.logits, g.output_logprobs):
            ref = torch.log_softmax(logits.float(), -1)
            assert lp == pytest.approx(float(ref[tok]), abs=1e-6)
            assert [t for t, _ in top] == torch.topk(ref, 3).indices.tolist()
            assert all(x >= y for (_, x), (_, y) in zip(top, top[1:])) and lp <= 0 and math.isfinite(lp)


def test_no_alternatives_and_none(make_engine):
    eng = make_engine()
    rng = random.Random(5)
    a = Request(input_ids=toks(rng, 12), sampling=SamplingParams(max_new_tokens=3), logprobs=0)
    b = greedy(toks(rng, 12), 3)
    run_checked(eng, [a, b])
    assert [top for _, top in a.output_logprobs] == [[], [], []] and b.output_logprobs == []


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_a_bad_count_is_refused_at_submit(make_engine, bad):
    eng = make_engine()
    with pytest.raises(ValueError, match="logprobs"):
        eng.submit(Request(input_ids=[1, 2, 3], logprobs=bad))


@pytest.mark.parametrize("config", ["tiny-hybrid", "full-only"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("start", [0, 1, 17, 39])
def test_prompt_logprobs_are_recomputed_where_the_cache_holds_them(make_engine, config, page_size, start):
    """Prompt logprobs from `start`: the engine reuses the cache only up to start - 1,
    so the second identical prompt (fully cached) gets the values the first computed,
    equal to the no-cache oracle's; the part before still comes from the cache (all of
    it with full attention alone; a recurrent layer reuses only at a checkpoint)."""
    eng = make_engine(config, page_size=page_size, max_total_tokens=1024, chunked_prefill_size=8)
    rng = random.Random(11)
    prompt = toks(rng, 40)
    runs = []
    for _ in range(2):
        r = Request(input_ids=prompt, sampling=SamplingParams(max_new_tokens=2), logprobs=2,
                    prompt_logprobs_from=start)
        run_checked(eng, [r])
        runs.append(r)
    ref = torch.log_softmax(eng.model.reference(prompt).float(), -1) if hasattr(eng.model, "reference") else None
    for r in runs:
        assert len(r.prompt_logprobs) == len(prompt) - start
        for i, entry in enumerate(r.prompt_logprobs):
            pos = start + i
            if pos == 0:
                assert entry is None
                continue
            lp, top = entry
            assert len(top) == 2 and lp <= 0
            if ref is not None:
                assert lp == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=TOL)
    for (x, _), (y, _) in zip([e for e in runs[0].prompt_logprobs if e], [e for e in runs[1].prompt_logprobs if e]):
        assert x == pytest.approx(y, abs=TOL)
    cap = max(0, start - 1) // page_size * page_size
    cached = runs[1].metrics.cached_tokens
    assert cached == cap if config == "full-only" else cached <= cap  # up to the first scoring row
    assert runs[1].output_ids == runs[0].output_ids


def test_prompt_logprobs_past_the_prompt_are_refused(make_engine):
    eng = make_engine()
    with pytest.raises(ValueError, match="prompt_logprobs_from"):
        eng.submit(Request(input_ids=[1, 2, 3], prompt_logprobs_from=3))
    with pytest.raises(ValueError, match="prompt_logprobs_from"):
        eng.submit(Request(input_ids=[1, 2, 3], prompt_logprobs_from=-1))
