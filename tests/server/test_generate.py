"""SGLang's /generate over real HTTP: single, batch, stream, sessions, the cached-token
split, exactness of a reused turn against the cache-off engine, and /metrics agreeing
with what the responses said."""
import random

import pytest

from uniradix.engine import Engine

PRESET_FLAGS = dict(max_total_tokens=4096, max_running_requests=8)


@pytest.fixture(scope="module")
def oracle():
    """The same seeded model with the cache off: what every output must equal."""
    eng = Engine("tiny-hybrid", disable_radix_cache=True, **PRESET_FLAGS)

    def run(ids, n):
        return eng.generate(input_ids=list(ids), max_new_tokens=n).output_ids
    return run


def prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 250) for _ in range(n)]


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0}


def test_second_turn_is_cached_and_exact(server, oracle):
    p1 = prompt(1, 70)
    s, r1, _ = server.post("/generate", {"input_ids": p1, "sampling_params": greedy(6), "session_id": "conv-a"})
    assert s == 200, r1
    assert r1["output_ids"] == oracle(p1, 6)
    assert r1["meta_info"]["prompt_tokens"] == 70 and r1["meta_info"]["completion_tokens"] == 6
    p2 = p1 + r1["output_ids"] + prompt(2, 20)
    s, r2, _ = server.post("/generate", {"input_ids": p2, "sampling_params": greedy(6), "session_id": "conv-a"})
    assert s == 200, r2
    meta = r2["meta_info"]
    assert meta["cached_tokens"] >= 70, meta  # the first turn's prompt and all but its last output token
    assert meta["cached_tokens_details"]["device"] == meta["cached_tokens"]
    assert r2["output_ids"] == oracle(p2, 6)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    s, body, _ = server.post("/close_session", {"session_id": "conv-a"})
    assert s == 200 and body["closed"] is True
    server.audit()


def test_text_batch_and_per_prompt_params(server, oracle):
    body = {"text": ["hello world", "a longer prompt, also text"],
            "sampling_params": [greedy(3), greedy(5)], "rid": ["r-1", "r-2"]}
    s, out, _ = server.post("/generate", body)
    assert s == 200, out
    assert [o["meta_info"]["id"] for o in out] == ["r-1", "r-2"]
    assert [len(o["output_ids"]) for o in out] == [3, 5]
    for o, t, n in zip(out, body["text"], (3, 5)):
        assert o["output_ids"] == oracle(list(t.encode()), n)
        assert o["text"] == bytes(o["output_ids"]).decode("utf-8", errors="replace")


def test_stream_chunks_grow_and_end_with_done(server, oracle):
    p = prompt(3, 40)
    events = list(server.stream("/generate", {"input_ids": p, "stream": True, "sampling_params": greedy(5)}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    ids = [c["output_ids"] for c in chunks]
    assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:]))  # cumulative
    assert ids[-1] == oracle(p, 5)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_batch_stream_names_each_prompt(server):
    body = {"input_ids": [prompt(4, 20), prompt(5, 30)], "stream": True, "sampling_params": greedy(3)}
    events = list(server.stream("/generate", body))
    assert events[-1] == "[DONE]"
    last = {}
    for c in events[:-1]:
        last[c["index"]] = c
    assert sorted(last) == [0, 1]
    assert all(len(c["output_ids"]) == 3 and c["meta_info"]["finish_reason"] for c in last.values())


def test_stop_strings_and_stop_ids(server, oracle):
    p = prompt(6, 30)
    full = oracle(p, 12)
    stop_id = full[4]
    s, out, _ = server.post("/generate", {"input_ids": p, "sampling_params": {
        **greedy(12), "stop_token_ids": [stop_id]}})
    assert s == 200
    k = full.index(stop_id)
    assert out["output_ids"] == full[:k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    # a stop string: the text ends before it, the tokens stop with the one that completed it
    seed = next(sd for sd in range(6, 60) if any(33 <= b < 127 for b in oracle(prompt(sd, 30), 12)))
    p = prompt(seed, 30)
    full = oracle(p, 12)
    stop = next(chr(b) for b in full if 33 <= b < 127)
    s, out, _ = server.post("/generate", {"input_ids": p, "sampling_params": {**greedy(12), "stop": [stop]}})
    assert s == 200, out
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"]
    assert out["output_ids"] == full[:full.index(ord(stop)) + 1]


def test_metrics_agree_with_responses(server):
    before = server.wait_idle()
    sent = []
    for i in range(4):
        p = prompt(10 + i % 2, 50)  # two prompts, each sent twice: the second reuses
        s, out, _ = server.post("/generate", {"input_ids": p, "sampling_params": greedy(4)})
        assert s == 200
        sent.append(out["meta_info"])
    after = server.wait_idle()

    def grew(name):
        return after[name] - before[name]
    assert grew("uniradix_prompt_tokens_total") == sum(m["prompt_tokens"] for m in sent)
    cached = sum(grew(f'uniradix_cached_tokens_total{{tier="{t}"}}') for t in ("device", "host", "storage"))
    assert cached == sum(m["cached_tokens"] for m in sent) > 0
    assert grew("uniradix_output_tokens_total") == sum(m["completion_tokens"] for m in sent)
    assert grew("uniradix_requests_finished_total") == 4
    assert grew("uniradix_time_to_first_token_seconds_count") == 4


def test_admin_routes(server):
    s, body, _ = server.get("/get_model_info")
    assert s == 200 and body["is_generation"] and body["vocab_size"] > 0 and body["layers"]
    s, body, _ = server.get("/get_server_info")
    assert s == 200 and body["max_total_tokens"] == 4096 and body["host"] == "127.0.0.1"
    assert server.get("/health")[0] == 200
    assert server.get("/health_generate")[0] == 200
    server.wait_idle()
    s, body, _ = server.post("/flush_cache")
    assert s == 200, body
    m = server.metrics()
    assert m['uniradix_cached_pages{component="full"}'] == 0
    server.audit()
