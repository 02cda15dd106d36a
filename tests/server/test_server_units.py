"""Server mechanisms driven directly, without HTTP: the runner's sessions across a close
and reopen, the API-key guard's bytes, secrets in the reported extra config, text from
invalid bytes."""
import asyncio
import json

from uniradix.config import redact_extra_config
from uniradix.engine import Request, SamplingParams
from uniradix.model.tokenizer import ByteTokenizer
from uniradix.server.app import Guard
from uniradix.server.runner import EngineRunner, Stream
from uniradix.server.settings import ServerConfig
from uniradix.server.textout import TextOut
from uniradix.tree.keys import session_key


def submit(runner, loop, ids, n, sid):
    s = Stream(Request(input_ids=ids, sampling=SamplingParams(max_new_tokens=n), session_id=sid), loop)
    assert runner.engine.prepare(s.req) is None
    assert runner.admit(1, 100)
    runner._handle("submit", s)
    return s


def test_a_turn_of_a_closed_session_does_not_touch_its_reopened_namesake(make_engine):
    eng = make_engine()
    runner = EngineRunner(eng, session_timeout=0.5)
    loop = asyncio.new_event_loop()
    try:
        a = submit(runner, loop, list(range(3, 40)), 6, "conv")
        eng.step()
        runner._emit()
        runner.close_session("conv")                    # while turn a runs
        b = submit(runner, loop, list(range(3, 60)), 30, "conv")   # the id reopens itself
        while not a.req.done:
            eng.step()
            runner._emit()
        assert runner.sessions.is_open("conv")
        assert runner.sessions.expired(now=1e12) == []  # b still runs: it keeps the session
        assert session_key("conv") not in eng.cache.tree.sessions    # a left no reference behind
        while not b.req.done:
            eng.step()
            runner._emit()
        assert session_key("conv") in eng.cache.tree.sessions        # b's turn is referenced
        assert runner.sessions.expired(now=1e12) == [("conv", None)]
        assert runner.close_session("conv") and session_key("conv") not in eng.cache.tree.sessions
    finally:
        loop.close()


def test_the_api_key_is_compared_as_utf8_bytes():
    guard = Guard(None, ServerConfig(api_key="clé"))

    def scope(value: bytes, path="/generate"):
        return {"type": "http", "path": path, "headers": [(b"authorization", value)]}
    assert guard.refuse(scope("Bearer clé".encode("utf-8"))) is None
    assert guard.refuse(scope("Bearer clé".encode("latin-1"))).status_code == 401
    assert guard.refuse(scope(b"Bearer cl")).status_code == 401
    assert guard.refuse(scope(b"", "/health")) is None


def test_secrets_inside_the_extra_config_are_hidden():
    shown = json.loads(redact_extra_config(json.dumps({
        "path": "/data", "auth_secret": "s1", "api_key": "s2", "private_key": "s3",
        "hosts": [{"password": "s4"}, "redis://user:s5@127.0.0.1:6379/0"], "nested": {"token": "s6"}})))
    assert "s1" not in json.dumps(shown) and all(f"s{i}" not in json.dumps(shown) for i in range(1, 7))
    assert shown["path"] == "/data" and shown["hosts"][1] == "redis://user:***@127.0.0.1:6379/0"
    assert redact_extra_config("@/etc/uniradix.json") == "@/etc/uniradix.json"
    assert redact_extra_config("{not json") == "<hidden>"


def test_invalid_bytes_do_not_hold_the_text_back():
    out = TextOut(ByteTokenizer())
    shown = [out.update([0x80], False) for _ in range(8)]
    assert shown[3] != "" and shown[-1] == "\ufffd" * len(shown[-1]) and len(shown[-1]) >= 5
