"""uniradix serve behind SGLang's gateway (smg 1.13, `smg launch`): it classifies the
workers as SGLang's (from /v1/models, then /server_info and /model_info), reads their
load reports (/v1/loads) for load-aware routing and overload protection, and serves
/generate (token ids, text, streamed), the OpenAI routes and sessions through every
policy it has. Sessions: the gateway routes no session route, so a session's turns go
to one worker by a routing key and its /close_session goes to that worker, named in
the gateway's x-smg-routed-worker-id header."""
from __future__ import annotations

import os
import time

import pytest
from gateway_proc import GatewayProc, smg_binary
from server_proc import HANG_S, ServerProc

if smg_binary() is None:
    if os.environ.get("CI"):
        pytest.fail("smg is not installed (a test dependency); CI must have it", pytrace=False)
    pytest.skip("smg is not installed (pip install smg)", allow_module_level=True)

POLICIES = ("round_robin", "random", "cache_aware", "consistent_hashing", "prefix_hash", "power_of_two",
            "least_load", "manual")
#: in the default run: one blind, the cache-aware and one load-aware policy (the load
#: report's reader); the other five under -m slow (about 6 s each)
FAST_POLICIES = ("round_robin", "cache_aware", "least_load")
GEN = {"sampling_params": {"max_new_tokens": 4, "temperature": 0}}


@pytest.fixture(scope="module")
def workers():
    # the second speculates (its /get_server_info carries SGLang's internal_states, its
    # meta_info the drafts): the gateway serves both alike, the same greedy replies
    ws = [ServerProc("--max-total-tokens", "4096", "--max-running-requests", "8", *spec)
          for spec in ((), ("--speculative-algorithm", "NGRAM"))]
    yield ws
    for w in ws:
        assert w.stop() == 0, "".join(w.lines[-30:])


def urls(ws) -> list[str]:
    return [f"http://127.0.0.1:{w.port}" for w in ws]


@pytest.mark.parametrize("policy", [p if p in FAST_POLICIES else pytest.param(p, marks=pytest.mark.slow)
                                    for p in POLICIES])
def test_every_policy_serves_every_route(workers, policy):
    gw = GatewayProc(urls(workers), policy)
    try:
        assert {w["runtime_type"] for w in gw.workers()} == {"sglang"}
        seen = set()
        for i in range(3):
            status, out, at = gw.routed("/generate", {"input_ids": [5 + i, 6, 7, 8, 9], **GEN})
            assert status == 200 and len(out["output_ids"]) == 4, out
            assert out["meta_info"]["cached_tokens_details"]["device"] >= 0
            seen.add(at)
            status, out, at = gw.routed("/generate", {"text": f"hello {i}", **GEN})
            assert status == 200 and "text" in out, out
            status, out, _ = gw.routed("/v1/completions", {"model": "tiny-hybrid", "prompt": "hi there",
                                                           "max_tokens": 3})
            assert status == 200 and out["usage"]["completion_tokens"] == 3, out
            status, out, _ = gw.routed("/v1/chat/completions", {"model": "tiny-hybrid", "max_tokens": 3,
                                                                "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200 and out["choices"][0]["message"]["role"] == "assistant", out
        assert seen <= set(urls(workers)) and seen
        events = list(gw.stream("/generate", {"input_ids": [9, 8, 7], "stream": True, **GEN}))
        assert events[-1] == "[DONE]" and len(events[-2]["output_ids"]) == 4, events
    finally:
        gw.stop()


def test_loads_and_metadata_reach_the_gateway(workers):
    from uniradix.engine import Engine
    # each worker's FULL pool: what --max-total-tokens 4096 leaves it (engine.build.kv_split)
    full_tokens = Engine("tiny-hybrid", max_total_tokens=4096, max_running_requests=8).pools["full"].size
    gw = GatewayProc(urls(workers), "power_of_two", "--load-monitor-interval", "1")
    try:
        ws = {w["url"]: w for w in gw.workers()}
        assert set(ws) == set(urls(workers))
        for url, w in ws.items():
            assert w["runtime_type"] == "sglang" and w["is_healthy"]
        deadline = time.monotonic() + HANG_S
        while True:   # the gateway polls each worker on its own schedule
            status, loads, _ = gw.get("/get_loads")
            assert status == 200, loads
            if {x["worker"] for x in loads["loads"]} == set(urls(workers)) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert {x["worker"] for x in loads["loads"]} == set(urls(workers)), loads
        for x in loads["loads"]:
            assert isinstance(x["num_running_reqs"], int) and isinstance(x["max_total_num_tokens"], int)
            assert 0.0 <= x["token_usage"] <= 1.0 and x["max_total_num_tokens"] == full_tokens
        status, out, _ = gw.post("/flush_cache")   # fanned out to every worker
        assert status == 200 and out["workers_flushed"] == 2, out
    finally:
        gw.stop()


def test_a_session_stays_on_one_worker_and_closes_there(workers):
    gw = GatewayProc(urls(workers), "consistent_hashing")
    try:
        conv = list(range(20, 80))
        where = set()
        cached = []
        for turn in range(3):
            status, out, at = gw.routed("/generate", {"input_ids": conv, "session_id": "conv-7", **GEN},
                                        headers={"X-SMG-Routing-Key": "conv-7"})
            assert status == 200, out
            where.add(at)
            cached.append(out["meta_info"]["cached_tokens"])
            conv = conv + out["output_ids"] + [100 + turn, 101, 102]
        assert len(where) == 1 and cached[0] == 0 and cached[1] >= 60 and cached[2] > cached[1], (where, cached)
        (url,) = where
        worker = next(w for w in workers if url.endswith(f":{w.port}"))
        assert worker.metrics()["uniradix_sessions_open"] >= 1
        # the gateway routes no /close_session: it goes to the worker the turns went to
        assert gw.post("/close_session", {"session_id": "conv-7"})[0] == 404
        status, out, _ = worker.post("/close_session", {"session_id": "conv-7"})
        assert status == 200 and out["closed"], out
    finally:
        gw.stop()


def test_the_multiturn_client_through_the_gateway(workers, capsys):
    """`uniradix bench multiturn --routing-key` against the gateway: each conversation
    stays on one worker (its hit rate from round 2 on), and its session is closed on
    that worker at the end (the gateway routes no /close_session)."""
    from uniradix.cli import main
    gw = GatewayProc(urls(workers), "consistent_hashing")
    try:
        code = main(["bench", "multiturn", "--url", f"http://127.0.0.1:{gw.port}", "--clients", "4", "--rounds", "3",
                     "--preamble-words", "10", "--document-words", "40", "--new-words", "6", "--output-tokens", "3",
                     "--routing-key", "--no-progress", "--seed", "11"])
        out = capsys.readouterr().out
        assert code == 0, out
        rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
        assert all(float(r[3].rstrip("%")) > 50 for r in rows[1:]), out   # every later turn found its worker
        assert all(w.metrics()["uniradix_sessions_open"] == 0 for w in workers)
    finally:
        gw.stop()
