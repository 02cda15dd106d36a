"""CPU work a request asks for never holds the event loop: while a large /tokenize,
/detokenize or chat template is being worked on, /health and a one-token /generate are
answered. And query values are checked as values: non-ASCII digits, overflowing,
negative or malformed numbers and flags are a 400 naming the parameter, never a 500.

The server runs in this process (uvicorn on a thread) so that the tokenizer can be
gated: its work on a marked input waits until the test lets it go, so "still in flight"
is a fact of the test, not a race against the clock."""
from __future__ import annotations

import http.client
import json
import socket
import threading
from contextlib import contextmanager

import pytest

from uniradix.engine import Engine
from uniradix.server.app import build_app
from uniradix.server.metrics import ServerMetrics
from uniradix.server.runner import EngineRunner
from uniradix.server.settings import ServerConfig

#: an input that holds the tokenizer at the gate: text with this character, ids with this id
MARK = "\x07"
HANG_S = 60.0   # catches a hang only: on a loaded machine every answer below comes far sooner


class GatedTokenizer:
    """The model's tokenizer, except that encoding a text with MARK in it or decoding
    ids with ord(MARK) in them waits at a gate until `release` is set: that work is in
    flight for as long as the test wants."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def _hold(self) -> None:
        self.entered.set()
        self.release.wait(2 * HANG_S)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if MARK in text:
            self._hold()
        return self.inner.encode(text, add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if ord(MARK) in ids:
            self._hold()
        return self.inner.decode(ids, skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextmanager
def serving(engine: Engine):
    """The server's app on a free 127.0.0.1 port, in this process; stopped at the end."""
    import uvicorn
    config = ServerConfig(port=0)
    metrics = ServerMetrics()
    runner = EngineRunner(engine, metrics)
    app = build_app(runner, config, metrics, "tiny-hybrid", {})
    runner.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(HANG_S)
        runner.stop(timeout=HANG_S)
        sock.close()


def call(port: int, method: str, path: str, body=None) -> tuple[int, dict | bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_S)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw
    finally:
        conn.close()


@pytest.fixture(scope="module")
def server():
    eng = Engine("tiny-hybrid", page_size=4)
    gate = GatedTokenizer(eng.tokenizer)
    eng.tokenizer = gate
    with serving(eng) as port:
        yield port, gate


BIG = 3 << 20   # characters: a body of several MB


@pytest.mark.parametrize("path,body,check", [
    ("/tokenize", {"prompt": MARK + "a" * BIG}, lambda r: r["count"] == BIG + 1),
    ("/tokenize", {"prompt": ["b" * 1000, MARK + "a" * BIG]}, lambda r: r["count"] == [1000, BIG + 1]),
    ("/tokenize", {"messages": [{"role": "user", "content": MARK + "a" * BIG}]},          # the chat prompt
     lambda r: r["count"] > BIG),
    ("/detokenize", {"tokens": [ord(MARK)] + [97] * (BIG // 8)}, lambda r: r["text"] == MARK + "a" * (BIG // 8)),
], ids=["tokenize", "tokenize-list", "tokenize-chat", "detokenize"])
def test_health_and_a_one_token_generate_are_answered_while_a_big_tokenize_runs(server, path, body, check):
    port, gate = server
    gate.entered.clear()
    gate.release.clear()
    answer = {}

    def big():
        answer["r"] = call(port, "POST", path, body)

    t = threading.Thread(target=big, daemon=True)
    t.start()
    try:
        assert gate.entered.wait(HANG_S), "the big request never reached the tokenizer"
        # the big request is held inside the tokenizer: everything below is answered meanwhile
        assert call(port, "GET", "/health")[0] == 200
        status, out = call(port, "POST", "/generate", {"input_ids": [5, 6, 7, 8, 9],
                                                        "sampling_params": {"max_new_tokens": 1}})
        assert status == 200 and len(out["output_ids"]) == 1
        assert call(port, "GET", "/v1/loads")[0] == 200
        assert "r" not in answer       # still held: these came back first
    finally:
        gate.release.set()
        t.join(HANG_S)
    status, out = answer["r"]
    assert status == 200 and check(out)


@pytest.mark.parametrize("path,name", [
    ("/cache/tree?depth=\u00b2", "depth"),                 # a superscript two: str.isdigit() says yes
    ("/cache/tree?depth=\uff14", "depth"),                 # a fullwidth four
    ("/cache/tree?depth=-1", "depth"),
    ("/cache/tree?depth=" + "9" * 5000, "depth"),          # past int()'s digit limit
    ("/cache/tree?depth=99999999999999999999", "depth"),
    ("/cache/tree?depth=1e3", "depth"),
    ("/cache/tree?depth=%204", "depth"),
    ("/cache/tree?depth=", "depth"),
    ("/cache/tree?children=0", "children"),
    ("/cache/tree?children=\u0661", "children"),           # an Arabic-Indic one
    ("/flush_cache?force=\u00b2", "force"),
    ("/flush_cache?force=maybe", "force"),
    ("/v1/loads?dp_rank=\u00b2", "dp_rank"),
], ids=lambda v: ascii(v)[:40])
def test_query_values_are_checked_as_values(server, path, name):
    port, _ = server
    status, out = call(port, "GET", path.replace("\u00b2", "%C2%B2").replace("\uff14", "%EF%BC%94")
                        .replace("\u0661", "%D9%A1"))
    assert status == 400, out
    assert out["error"]["message"].startswith(name), out


@pytest.mark.parametrize("path", ["/cache/tree?depth=0", "/cache/tree?depth=64&children=1024",
                                  "/cache/tree?depth=007", "/flush_cache?force=true", "/flush_cache?force=0",
                                  "/flush_cache", "/v1/loads?dp_rank=0&include=core,queues"])
def test_query_values_in_range_are_taken(server, path):
    port, _ = server
    assert call(port, "GET", path)[0] == 200
