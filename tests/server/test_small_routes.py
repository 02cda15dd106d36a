"""The small routes and answers SGLang's and vLLM's users expect: several served names
and a 404 for any other, /tokenize and /detokenize in both servers' shapes, /version,
vLLM's /reset_prefix_cache, and /get_server_info telling the port actually bound and
the checkpoint actually served."""
from __future__ import annotations

import json
import time
import sys
from pathlib import Path

import pytest
from server_proc import HANG_S, ServerProc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model" / "hf"))


@pytest.fixture(scope="module")
def named():
    s = ServerProc("--max-total-tokens", "4096", "--served-model-name", "first", "second")
    yield s
    assert s.stop() == 0, "".join(s.lines[-30:])


def test_served_names_and_a_404_for_any_other(named):
    status, out, _ = named.get("/v1/models")
    assert status == 200 and [m["id"] for m in out["data"]] == ["first", "second"], out
    assert all("max_model_len" in m for m in out["data"])  # null: the embedded model has no context limit
    for model in ("second", None):
        body = {"prompt": "hello", "max_tokens": 2, **({"model": model} if model else {})}
        status, out, _ = named.post("/v1/completions", body)
        assert status == 200 and out["model"] == "first", out
    status, out, _ = named.post("/v1/chat/completions", {"model": "third", "messages": [{"role": "user",
                                                                                           "content": "hi"}]})
    assert status == 404 and "'third'" in out["error"]["message"] and "'first', 'second'" in out["error"]["message"]
    status, out, _ = named.post("/v1/completions", {"model": "third", "prompt": "hi"})
    assert status == 404, out


def test_tokenize_and_detokenize_in_both_shapes(named):
    status, out, _ = named.post("/tokenize", {"model": "first", "prompt": "héllo"})
    assert status == 200 and out["tokens"] == list("héllo".encode()) and out["count"] == 6, out
    assert "max_model_len" in out
    status, out, _ = named.post("/tokenize", {"prompt": ["ab", "c"]})           # SGLang's batch form
    assert status == 200 and out["tokens"] == [[97, 98], [99]] and out["count"] == [2, 1], out
    status, chat, _ = named.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and chat["count"] == len(chat["tokens"]) > 2, chat
    status, out, _ = named.post("/detokenize", {"tokens": list("héllo".encode())})
    assert status == 200 and out["prompt"] == out["text"] == "héllo", out
    status, out, _ = named.post("/detokenize", {"tokens": [[104, 105], [33]]})
    assert status == 200 and out["text"] == ["hi", "!"], out
    for bad, field in (({"tokens": [1, 999]}, "999"), ({"tokens": "x"}, "tokens"), ({"prompt": 5}, "prompt"),
                       ({"prompt": "a", "model": "third"}, "third")):
        route = "/detokenize" if "tokens" in bad else "/tokenize"
        status, out, _ = named.post(route, bad)
        assert status in (400, 404) and field in out["error"]["message"], (bad, out)


def test_version_and_reset_prefix_cache(named):
    status, out, _ = named.get("/version")
    assert status == 200 and out["version"], out
    body = {"text": "a prompt the cache will hold for a moment " * 4, "sampling_params": {"max_new_tokens": 1}}
    named.post("/generate", body)
    status, out, _ = named.post("/generate", body)
    assert out["meta_info"]["cached_tokens"] > 0, out
    status, out, _ = named.post("/reset_prefix_cache")
    assert status == 200, out
    status, out, _ = named.post("/generate", body)
    assert out["meta_info"]["cached_tokens"] == 0, out


def test_server_info_tells_the_bound_port_and_the_served_checkpoint(tmp_path):
    import harness
    path = harness.make_tiny("qwen3", str(tmp_path / "qwen3"))
    s = ServerProc("--model-path", path, "--max-total-tokens", "1024")
    try:
        status, info, _ = s.get("/get_server_info")
        assert status == 200, info
        assert info["port"] == s.port != 0, info
        assert info["model_path"] == path and info["model_preset"] is None, info
        assert info["context_length"] > 0
        assert "\"port\": %d" % s.port in "".join(s.lines), s.lines[-5:]   # the settings line too
    finally:
        assert s.stop() == 0, "".join(s.lines[-30:])


def test_request_lines_and_the_busy_line():
    """--log-requests: one line per finished request, with its tokens by tier; while
    busy, a line every --log-interval seconds with the queues, the prompt tokens new and
    cached, decode throughput and each component's pool in use."""
    import time
    s = ServerProc("--max-total-tokens", "4096", "--log-requests", "--log-interval", "0.2")
    try:
        body = {"text": "a prompt sent twice, so that the second reuses it " * 3,
                "sampling_params": {"max_new_tokens": 24}, "rid": "first"}
        assert s.post("/generate", body)[0] == 200
        assert s.post("/generate", {**body, "rid": "second"})[0] == 200
        time.sleep(1.5)
        log = "".join(s.lines)
        first = next(line for line in s.lines if "request first:" in line)
        second = next(line for line in s.lines if "request second:" in line)
        assert "finished (length)" in first and "cached 0 " in first and "output 24" in first, first
        assert "cached 0 " not in second and "TTFT" in second and "latency" in second, second
        busy = [line for line in s.lines if "activity, last" in line]
        assert busy, log[-2000:]
        assert "running" in busy[0] and "waiting" in busy[0] and "tok/s" in busy[0] and "full " in busy[0], busy
    finally:
        assert s.stop() == 0, "".join(s.lines[-30:])


def test_cache_tree_shows_the_tree(named):
    """Spans chain (a node starts where its parent ends), every component's slot is named
    with its tier, the depth limit holds, and a salted tenant's root is shown by a
    digest, never by its salt."""
    base = list(range(40, 90))
    for tail in ([5, 6, 7], [8, 9, 10, 11]):
        assert named.post("/generate", {"input_ids": base + tail, "sampling_params": {"max_new_tokens": 2}})[0] == 200
    status, shape, _ = named.get("/cache/tree?depth=8")
    assert status == 200, shape
    assert shape["components"] and shape["nodes"] >= 1 and shape["depth"] == 8

    def walk(node, parent_end, depth):
        assert node["start"] == parent_end and node["tokens"] == node["end"] - node["start"] > 0, node
        assert set(node["components"]) == set(shape["components"]) == set(node["locks"])
        assert set(node["components"].values()) <= {"device", "host", "device+host", "absent"}
        assert depth <= 8
        return 1 + sum(walk(c, node["end"], depth + 1) for c in node["children"])

    (root,) = [r for r in shape["roots"] if r["salt"] is None]
    seen = sum(walk(c, 0, 1) for c in root["children"])
    assert seen >= 1 and any(c["components"]["full"] != "absent" for c in root["children"])
    status, flat, _ = named.get("/cache/tree?depth=0")
    assert status == 200 and all(r["children"] == [] for r in flat["roots"])
    assert sum(r["more_children"] for r in flat["roots"]) >= 1
    named.post("/generate", {"input_ids": base, "cache_salt": "tenant", "sampling_params": {"max_new_tokens": 1}})
    status, shape, _ = named.get("/cache/tree")
    salted = [r["salt"] for r in shape["roots"] if r["salt"] is not None]
    assert salted and "tenant" not in json.dumps(shape), shape     # a salt is shown by a digest only
    for bad in ("depth=-1", "depth=x", "children=0", "depth=65"):
        status, out, _ = named.get(f"/cache/tree?{bad}")
        assert status == 400 and bad.split("=")[0] in out["error"]["message"], (bad, out)


def test_load_report_in_sglangs_shape(named):
    """/v1/loads as SGLang's gateway parses it: integer counts, no null anywhere; the
    cached pages a new request could evict do not count as used."""
    import threading
    for i in range(3):  # a warm cache: every page the tree holds is evictable
        assert named.post("/generate", {"input_ids": [x % 250 + 1 for x in range(5 + i, 300)],
                                        "sampling_params": {"max_new_tokens": 2}})[0] == 200
    named.wait_idle()
    status, rep, _ = named.get("/v1/loads?include=core,disagg,queues,memory")
    assert status == 200, rep
    (load,) = rep["loads"]
    assert rep["dp_rank_count"] == 1 and isinstance(rep["timestamp"], str) and rep["version"]

    def no_nulls(x):
        return all(no_nulls(v) for v in x.values()) if isinstance(x, dict) else x is not None
    assert no_nulls(rep)
    for k in ("num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens", "max_total_num_tokens",
              "max_running_requests", "num_waiting_uncached_tokens"):
        assert type(load[k]) is int, k
    assert load["token_usage"] == 0.0 and load["num_running_reqs"] == 0 and 0 < load["cache_hit_rate"] < 1
    # the FULL pool's tokens: what the KV budget of --max-total-tokens 4096 leaves it once
    # the window pool took what it needs (engine.build.kv_split)
    from uniradix.engine import Engine
    assert load["max_total_num_tokens"] == Engine("tiny-hybrid", max_total_tokens=4096).pools["full"].size > 4096
    # while a long request runs, its pages are used
    done = threading.Event()
    threading.Thread(target=lambda: (named.post("/generate", {"input_ids": list(range(1, 200)), "sampling_params": {
        "max_new_tokens": 300, "ignore_eos": True}}), done.set()), daemon=True).start()
    deadline = time.monotonic() + HANG_S
    while True:
        load = named.get("/v1/loads")[1]["loads"][0]
        if load["num_running_reqs"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert load["num_running_reqs"] == 1 and load["token_usage"] > 0 and load["num_used_tokens"] >= 199, load
    done.wait(HANG_S)
    status, out, _ = named.get("/v1/loads?dp_rank=1")
    assert status == 400 and "dp_rank" in out["error"]["message"], out
    assert named.get("/v1/loads?include=a-section-of-a-later-sglang")[0] == 200   # the core numbers anyway
    # SGLang's newer metadata routes, and what owns the model, as its gateway reads them
    assert named.get("/server_info")[1]["max_total_tokens"] == 4096
    assert named.get("/model_info")[1]["is_generation"] is True
    assert {m["owned_by"] for m in named.get("/v1/models")[1]["data"]} == {"sglang"}
