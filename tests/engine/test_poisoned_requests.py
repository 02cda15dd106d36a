"""One bad request must never break the batch it runs in.

Two defences, both checked here: `submit()` refuses every malformed field with a
ValueError naming it (types too), and a step is failure-atomic: whatever fails inside
it because of one request (a field changed after submit, a bug) fails that request
alone (status "error", its handles back in the pools), while the others in the same
batch finish exactly as the oracle says, with every handle owned once."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from engine_checks import (Request, SamplingParams, check_exact, check_ownership, check_settled, greedy,
                           toks)

# --------------------------------------------------------------------------- submit() refuses
BAD_FIELDS = [
    # (field named in the message, how to build the request)
    ("input_ids", lambda: Request(input_ids=[1.0, 2, 3])),
    ("input_ids", lambda: Request(input_ids=[1, True, 3])),
    ("input_ids", lambda: Request(input_ids=["1", "2"])),
    ("input_ids", lambda: Request(input_ids="abc")),
    ("input_ids", lambda: Request(input_ids=b"abc")),
    ("input_ids", lambda: Request(input_ids=[1, 256])),           # the vocabulary is 256
    ("input_ids", lambda: Request(input_ids=[-1, 2])),
    ("input_ids", lambda: Request(input_ids=[2 ** 40])),
    ("input_ids", lambda: Request(input_ids=5)),
    ("text", lambda: Request(text=123)),
    ("priority", lambda: Request(input_ids=[1, 2], priority="high")),
    ("priority", lambda: Request(input_ids=[1, 2], priority=1.5)),
    ("priority", lambda: Request(input_ids=[1, 2], priority=True)),
    ("priority", lambda: Request(input_ids=[1, 2], priority=[1])),
    ("salt", lambda: Request(input_ids=[1, 2], salt=["tenant"])),
    ("salt", lambda: Request(input_ids=[1, 2], salt={"a": 1})),
    ("salt", lambda: Request(input_ids=[1, 2], salt=1.0)),
    ("salt", lambda: Request(input_ids=[1, 2], salt=True)),
    ("session_id", lambda: Request(input_ids=[1, 2], session_id=["chat"])),
    ("session_id", lambda: Request(input_ids=[1, 2], session_id={})),
    ("session_id", lambda: Request(input_ids=[1, 2], session_id=1.5)),
    ("session_id", lambda: Request(input_ids=[1, 2], session_id=True)),
    ("record_logits", lambda: Request(input_ids=[1, 2], record_logits="yes")),
    ("stop_ids", lambda: Request(input_ids=[1, 2], sampling=SamplingParams(stop_ids=(999,)))),
    ("sampling", lambda: Request(input_ids=[1, 2], sampling={"max_new_tokens": 3})),
]


@pytest.mark.parametrize("field,make", BAD_FIELDS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_FIELDS)])
def test_submit_refuses_a_bad_field_and_names_it(make_engine, field, make):
    eng = make_engine("tiny-hybrid")
    req = make()
    with pytest.raises(ValueError, match=field):
        eng.submit(req)
    assert req.status == "new" and not eng.waiting and not eng.running


BAD_SAMPLING = [
    ("max_new_tokens", dict(max_new_tokens=2.0)),
    ("max_new_tokens", dict(max_new_tokens=True)),
    ("max_new_tokens", dict(max_new_tokens="3")),
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature=-0.5)),
    ("temperature", dict(temperature="1")),
    ("top_p", dict(top_p=math.nan)),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.5)),
    ("seed", dict(seed=1.5)),
    ("seed", dict(seed=True)),
    ("seed", dict(seed=-1)),
    ("stop_ids", dict(stop_ids=(1.5,))),
    ("stop_ids", dict(stop_ids=(True,))),
    ("stop_ids", dict(stop_ids="ab")),
]


@pytest.mark.parametrize("field,kw", BAD_SAMPLING, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_SAMPLING)])
def test_sampling_params_refuse_bad_values(field, kw):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_accepted_forms_still_work(make_engine):
    """numpy ids, tuples and a subnormal temperature (greedy, as SGLang treats any
    temperature below 1e-5) are fine; the outputs are exact."""
    eng = make_engine("tiny-hybrid")
    rng = random.Random(1)
    ids = toks(rng, 20)
    reqs = [Request(input_ids=np.array(ids, dtype=np.int64), sampling=SamplingParams(max_new_tokens=4),
                    record_logits=True),
            Request(input_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=4, temperature=5e-324),
                    record_logits=True, salt=b"t", session_id=7, priority=-2)]
    eng.run(reqs)
    for r in reqs:
        check_exact(eng, r)
    assert reqs[1].sampling.temperature == 0 and reqs[0].output_ids == reqs[1].output_ids


# --------------------------------------------------------------------------- a step is failure-atomic
def _state(eng, req):
    return next(s for s in eng.waiting if s.owner is req)


def _poison_priority(eng, req):
    _state(eng, req).priority = "urgent"          # fails when the tree is asked to match


def _poison_salt(eng, req):
    _state(eng, req).salt = ["not", "hashable"]   # fails at the match too


def _poison_session(eng, req):
    req.session_id = {"not": "hashable"}  # fails when the finished request is cached


def _poison_temperature(eng, req):
    object.__setattr__(req.sampling, "temperature", math.nan)  # fails when sampling


def _poison_token(eng, req):
    _state(eng, req).tokens[-3] = 10 ** 6         # fails inside the batched forward (embedding lookup)


POISONS = {"priority": _poison_priority, "salt": _poison_salt, "session_id": _poison_session,
           "temperature": _poison_temperature, "forward": _poison_token}


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("kind", list(POISONS))
@pytest.mark.parametrize("position", range(4))
def test_a_poisoned_request_fails_alone_in_every_position(make_engine, kind, position, page):
    """Three good requests (two resuming from a cached conversation, so the recurrent
    state is restored from checkpoints) and one poisoned after submit (in the engine's
    own state for it, as a bug would, or in the client's request), in one batch. The
    poisoned one ends in "error" with its handles returned; the good ones are exact, and
    every handle is owned once after every step. The engine keeps serving afterwards."""
    eng = make_engine("tiny-hybrid", page_size=page, max_running_requests=8)
    rng = random.Random(100 + position)
    first = greedy(toks(rng, 24), 3)
    eng.run([first])
    history = first.input_ids + first.output_ids
    good = [greedy(history + toks(rng, 9), 5), greedy(history + toks(rng, 13), 5), greedy(toks(rng, 17), 5)]
    bad = greedy(history + toks(rng, 11), 5)
    batch = good[:position] + [bad] + good[position:]
    for r in batch:
        eng.submit(r)
        if r is bad:
            POISONS[kind](eng, r)
    steps = 0
    while eng.waiting or eng.running:
        eng.step()
        steps += 1
        check_ownership(eng)
        assert steps < 200
    assert bad.status == "error" and bad.done and bad.finish_reason == "error", (bad.status, bad.error)
    assert bad.error and f"request {bad.rid}" in bad.error
    assert all(s.req is not bad for s in list(eng.running) + list(eng.waiting))
    for r in good:
        check_exact(eng, r)
    assert good[0].metrics.cached_tokens > 0 and good[1].metrics.cached_tokens > 0
    assert eng.counters["errors"] == 1 and eng.counters["finished"] == 1 + len(good)
    check_settled(eng)
    later = greedy(history + toks(rng, 6), 3)
    eng.run([later])
    check_exact(eng, later)


@pytest.mark.parametrize("position", range(3))
def test_a_forward_that_fails_part_way_advances_no_state(make_engine, monkeypatch, position):
    """The batched forward fails in its third recurrent layer, because of one request,
    after the first two layers have run for everyone. The forward commits recurrent
    states only after its last layer, so rerunning the others alone advances their
    states once, and they stay exact; the culprit fails alone."""
    import uniradix.model.paged as paged
    real = paged._recurrent
    BAD_LEN = 13  # the poisoned request's prompt: no other request brings this many tokens

    def flaky(cfg, lw, mp, layer, h, inp, *rest):
        if len(inp.tokens) == BAD_LEN and layer == 2:
            raise RuntimeError("a kernel failed on this request")
        return real(cfg, lw, mp, layer, h, inp, *rest)

    eng = make_engine("jamba-like", page_size=4, max_running_requests=8)
    rng = random.Random(7 + position)
    first = greedy(toks(rng, 24), 3)
    eng.run([first])
    history = first.input_ids + first.output_ids
    good = [greedy(history + toks(rng, 9), 4), greedy(toks(rng, 17), 4)]
    bad = greedy(toks(rng, BAD_LEN), 4)
    monkeypatch.setattr(paged, "_recurrent", flaky)
    for r in good[:position] + [bad] + good[position:]:
        eng.submit(r)
    while eng.waiting or eng.running:
        eng.step()
        check_ownership(eng)
    assert bad.status == "error" and "kernel failed" in bad.error
    for r in good:
        check_exact(eng, r)
    check_settled(eng)


def test_what_the_engine_needs_is_taken_at_submit(make_engine):
    """Salt and priority are checked and copied at submit: a client that changes its
    request afterwards changes nothing the engine uses."""
    eng = make_engine("tiny-hybrid")
    rng = random.Random(3)
    r = greedy(toks(rng, 20), 3)
    r.salt, r.priority = "tenant", 1
    eng.submit(r)
    r.salt, r.priority = ["not", "hashable"], "urgent"
    eng.run([r])
    check_exact(eng, r)
    again = greedy(r.input_ids + r.output_ids, 2)
    again.salt = "tenant"
    eng.run([again])
    assert again.metrics.cached_tokens > 0
