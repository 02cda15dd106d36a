"""Engine.abort (a client that went away) in every state a request can be in, stop
strings, top-k, and prepare/enqueue (the server's split of submit)."""
import random

import pytest
import torch

import engine_checks as ec
from uniradix.engine import Request, SamplingParams
from uniradix.engine.sampling import sample
from uniradix.hicache.backends.file import FileBackend


def run(engine, reqs):
    for r in reqs:
        engine.submit(r)
    while engine.waiting or engine.running or engine.prefetching:
        engine.step()
        engine.audit()


@pytest.mark.parametrize("when", ["waiting", "prefill", "decode"])
def test_abort_gives_everything_back_and_the_others_stay_exact(make_engine, when):
    rng = random.Random(7)
    eng = make_engine(chunked_prefill_size=32, max_running_requests=1 if when == "waiting" else 4)
    others = [ec.greedy(ec.toks(rng, 90), 12) for _ in range(2)]
    victim = ec.greedy(ec.toks(rng, 120), 40)
    for r in (others[0], victim, others[1]):
        eng.submit(r)
    steps = 0
    while not victim.done:
        st = next((s for s in eng.running if s.owner is victim), None)
        ready = {"waiting": victim.status == "waiting" and steps > 0,
                 "prefill": st is not None and 0 < st.computed < len(victim.input_ids),
                 "decode": len(victim.output_ids) >= 3}[when]
        if ready:
            assert eng.abort(victim, "gone")
            break
        eng.step()
        steps += 1
    assert victim.status == "aborted" and victim.finish_reason == "abort" and victim.error == "gone"
    assert not eng.abort(victim)  # once only
    eng.audit()
    run(eng, [])
    for r in others:
        ec.check_exact(eng, r)
    assert eng.counters["aborted"] == 1


def test_abort_while_prefetching_from_storage(make_engine, tmp_path):
    rng = random.Random(3)
    ids = ec.toks(rng, 64)
    writer = make_engine(storage=FileBackend(str(tmp_path)))
    run(writer, [ec.greedy(ids, 2)])
    writer.flush_writes()
    reader = make_engine(storage=FileBackend(str(tmp_path)), prefetch_threshold=1,
                         hicache_storage_prefetch_policy="wait_complete")
    req = ec.greedy(ids + ec.toks(rng, 8), 4)
    reader.submit(req)
    reader.step()
    if req.status != "prefetching":
        pytest.skip(f"the read finished within the step ({req.status})")
    assert reader.abort(req)
    assert not reader.prefetching
    reader.audit()
    run(reader, [])
    again = ec.greedy(ids + ec.toks(rng, 8), 4)
    run(reader, [again])
    ec.check_exact(reader, again)


def test_abort_of_a_request_never_submitted_or_done(make_engine):
    eng = make_engine()
    r = ec.greedy([5, 6, 7], 2)
    assert not eng.abort(r)
    run(eng, [r])
    assert r.status == "finished" and not eng.abort(r)


def test_stop_string_ends_at_the_token_that_completes_it(make_engine):
    eng = make_engine()
    ids = list(b"a prompt for the stop string test")
    full = eng.generate(input_ids=ids, max_new_tokens=20).output_ids
    k = next(i for i, b in enumerate(full) if 33 <= b < 127)
    two = bytes(full[max(0, k - 1):k + 1]).decode("latin-1")
    stop = two if k > 0 and all(32 <= b < 127 for b in full[k - 1:k + 1]) else chr(full[k])
    r = eng.generate(input_ids=ids, max_new_tokens=20, stop=(stop,))
    assert r.finish_reason == "stop" and r.matched_stop == stop
    assert r.output_ids == full[:k + 1]
    r2 = eng.generate(input_ids=ids, max_new_tokens=20, stop="\x00never\x00")
    assert r2.output_ids == full and r2.finish_reason == "length"


def test_stop_and_top_k_are_checked():
    for bad in (dict(stop=5), dict(stop=[""]), dict(stop=["a", 3]), dict(top_k=0), dict(top_k=1.5),
                dict(top_k=True)):
        with pytest.raises(ValueError, match="stop|top_k"):
            SamplingParams(**bad)
    assert SamplingParams(stop="x").stop == ("x",)


def test_top_k_draws_only_from_the_k_likeliest():
    logits = torch.tensor([0.0, 5.0, 4.0, 3.0, -1.0])
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, SamplingParams(temperature=5.0, top_k=2), g) for _ in range(300)}
    assert seen == {1, 2}
    assert sample(logits, SamplingParams(temperature=5.0, top_k=1), g) == 1


def test_prepare_then_enqueue_is_submit(make_engine):
    eng = make_engine()
    r = Request(text="hello", sampling=SamplingParams(max_new_tokens=3))
    assert eng.prepare(r) is None and r.status == "new" and r.input_ids == list(b"hello")
    assert not eng.waiting  # prepare queues nothing
    eng.enqueue(r)
    run(eng, [])
    assert r.status == "finished" and len(r.output_ids) == 3
    too_big = Request(input_ids=[5] * 10, sampling=SamplingParams(max_new_tokens=10 ** 6))
    assert "never fit" in eng.prepare(too_big)
    with pytest.raises(ValueError, match="already submitted"):
        eng.prepare(r)


def euro_weights():
    """tiny-hybrid with its layers zeroed and a head that follows byte a with byte b: a
    greedy run from 0xE2 writes "€€€..." (three tokens per character)."""
    from uniradix.model import load_model
    m = load_model("tiny-hybrid")
    w, cfg = m.weights, m.config
    for lw in w["layers"]:
        for k, v in lw.items():
            if not k.startswith("norm"):
                lw[k] = torch.zeros_like(v)
    e = w["embed"]
    en = e / e.pow(2).mean(-1, keepdim=True).add(cfg.norm_eps).sqrt()
    head = torch.zeros_like(w["head"])
    for a, b in {0xE2: 0x82, 0x82: 0xAC, 0xAC: 0xE2}.items():
        head[:, b] = en[a]
    w["head"] = head
    return w


def test_a_stop_string_of_multibyte_characters_is_found(make_engine):
    eng = make_engine("tiny-hybrid", weights=euro_weights())
    free = eng.generate(input_ids=[5, 0xE2], max_new_tokens=20)
    assert bytes([0xE2] + free.output_ids).decode("utf-8", "replace").startswith("€€€€€")
    r = eng.generate(input_ids=[5, 0xE2], max_new_tokens=60, stop="€€€")
    # "€" is 3 tokens; the output's own text starts 82 AC (two invalid bytes), then
    # E2 82 AC three times: "€€€" ends at its 11th token (7 tokens hold only "€€")
    assert r.finish_reason == "stop" and r.matched_stop == "€€€" and len(r.output_ids) == 11
