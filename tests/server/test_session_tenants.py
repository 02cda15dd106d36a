"""A session belongs to the tenant it was opened under (its `cache_salt` and
`extra_key`, the partition reuse keeps): from any other tenant it does not exist, the
same answer as an id never opened, on every session route (`session_params`
continuation, a plain `session_id`, `/open_session`, `/close_session`), with or without
an API key. And a continuation of a session that is closed or expired is a 404 naming
the session, never a silent fresh start that reopens it."""
from __future__ import annotations

import asyncio
import time

import pytest
from server_proc import ServerProc

from uniradix.engine import Request, SamplingParams
from uniradix.server.request_log import salt_digest
from uniradix.server.runner import EngineRunner, Stream
from uniradix.tree.keys import session_key

A = list(range(30, 70))
B = list(range(100, 112))
C = list(range(140, 146))
SP = {"max_new_tokens": 5, "temperature": 0}
ALICE, BOB = {"cache_salt": "alice"}, {"cache_salt": "bob"}


class Client:
    """One server, every request with (or without) the API key."""

    def __init__(self, srv: ServerProc, key: str | None) -> None:
        self.srv, self.headers = srv, ({"Authorization": f"Bearer {key}"} if key else {})

    def post(self, path: str, body: dict):
        status, out, _ = self.srv.post(path, body, headers=self.headers)
        return status, out

    def gen(self, **fields):
        status, out = self.post("/generate", {"sampling_params": SP, **fields})
        assert status == 200, out
        return out

    def metric(self, name: str) -> float:
        status, text, _ = self.srv.get("/metrics", headers=self.headers)
        assert status == 200, text
        return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))

    def open(self, **fields) -> str:
        status, sid = self.post("/open_session", fields)
        assert status == 200 and isinstance(sid, str), sid
        return sid


@pytest.fixture(scope="module", params=[None, "sekrit"], ids=["no-key", "api-key"])
def client(request):
    key = request.param
    srv = ServerProc("--max-total-tokens", "4096", "--max-running-requests", "8",
                     *(("--api-key", key) if key else ()))
    yield Client(srv, key)
    assert srv.stop() == 0, "".join(srv.lines[-30:])


def _refused(client, sid: str, **fields) -> str:
    """A continuation of `sid` is a 404 naming it; the message, with the id taken out."""
    status, out = client.post("/generate", {"input_ids": [5], "sampling_params": SP, **fields})
    assert status == 404, out
    msg = out["error"]["message"]
    assert repr(sid) in msg, msg
    return msg.replace(repr(sid), "ID")


def test_another_tenant_cannot_continue_read_or_redirect_a_session(client):
    sid = client.open(**ALICE)
    t1 = client.gen(input_ids=A, rid="t1", session_params={"id": sid}, **ALICE)
    assert t1["meta_info"]["prompt_tokens"] == len(A)
    spy = {"return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True}
    # another salt, no salt, the same salt with another extra key: each is another tenant,
    # and the session does not exist for it (the same answer as an id never opened)
    for other in (BOB, {}, {**ALICE, "extra_key": "k"}, {"extra_key": "alice"}):
        for sp in ({"id": sid}, {"id": sid, "rid": "t1"}):
            seen = _refused(client, sid, session_params=sp, **other, **spy)
            never = {**sp, "id": "never-opened"}
            assert seen == _refused(client, "never-opened", session_params=never, **other, **spy), (other, sp)
    # the owner's next turn is built on its own turn, not on anything the others sent
    t2 = client.gen(input_ids=C, session_params={"id": sid}, **ALICE)
    assert t2["meta_info"]["prompt_tokens"] == len(A) + 5 + len(C)
    assert t2["output_ids"] == client.gen(input_ids=A + t1["output_ids"] + C, **ALICE)["output_ids"]
    status, out = client.post("/close_session", {"session_id": sid, **ALICE})
    assert status == 200 and out["closed"] is True


def test_another_tenant_can_neither_close_nor_take_over_a_session(client):
    sid = client.open(**ALICE)
    client.gen(input_ids=A, rid="t1", session_params={"id": sid}, **ALICE)
    for other in (BOB, {}):  # closing it from elsewhere: what an id never opened answers
        assert client.post("/close_session", {"session_id": sid, **other}) == \
            client.post("/close_session", {"session_id": "never-opened", **other})
        assert client.post("/close_session", {"session_id": sid, **other})[1]["closed"] is False
    # opening the same id elsewhere opens that tenant's own session: empty, apart
    assert client.open(session_id=sid, **BOB) == sid
    mine = client.gen(input_ids=B, rid="b1", session_params={"id": sid}, **BOB)
    assert mine["meta_info"]["prompt_tokens"] == len(B)   # nothing of alice's
    t2 = client.gen(input_ids=C, session_params={"id": sid}, **ALICE)
    assert t2["meta_info"]["prompt_tokens"] == len(A) + 5 + len(C)   # nothing of bob's
    assert client.post("/close_session", {"session_id": sid, **BOB})[1]["closed"] is True
    t3 = client.gen(input_ids=C, session_params={"id": sid, "rid": "t1"}, **ALICE)   # alice's is still open
    assert t3["meta_info"]["prompt_tokens"] == len(A) + 5 + len(C)
    assert client.post("/close_session", {"session_id": sid, **ALICE})[1]["closed"] is True
    assert client.post("/close_session", {"session_id": sid, **ALICE})[1]["closed"] is False


def test_a_plain_session_id_is_its_tenants_own(client):
    """The same `session_id` from two tenants (on /generate and the OpenAI routes) is two
    sessions: each keeps its own turn referenced in the tree, and closing one leaves the
    other's reference."""
    refs = "uniradix_session_references"
    before = client.metric(refs)
    client.gen(input_ids=A, session_id="shared", **ALICE)
    assert client.metric(refs) == before + 1
    status, out = client.post("/v1/completions", {"prompt": B, "max_tokens": 3, "temperature": 0,
                                                  "session_id": "shared", **BOB})
    assert status == 200, out
    assert client.metric(refs) == before + 2   # bob's turn did not replace alice's reference
    assert client.post("/close_session", {"session_id": "shared", **BOB})[1]["closed"] is True
    assert client.metric(refs) == before + 1
    assert client.post("/close_session", {"session_id": "shared", **ALICE})[1]["closed"] is True
    assert client.metric(refs) == before


def test_the_session_routes_need_the_api_key_when_one_is_set(client):
    if not client.headers:
        pytest.skip("no API key on this server")
    for path, body in (("/open_session", {}), ("/close_session", {"session_id": "x"}),
                       ("/generate", {"input_ids": C, "session_params": {"id": "x"}})):
        status, out, _ = client.srv.post(path, body)
        assert status == 401, (path, out)


@pytest.mark.parametrize("salt", [{}, ALICE], ids=["no-salt", "salt"])
def test_a_closed_session_is_not_continued_from_nothing(client, salt):
    sid = client.open(**salt)
    client.gen(input_ids=A, rid="t1", session_params={"id": sid}, **salt)
    assert client.post("/close_session", {"session_id": sid, **salt})[1]["closed"] is True
    _refused(client, sid, session_params={"id": sid}, **salt)
    _refused(client, sid, session_params={"id": sid, "rid": "t1"}, **salt)
    # the refused continuations did not reopen it
    assert client.post("/close_session", {"session_id": sid, **salt})[1]["closed"] is False


@pytest.mark.parametrize("salt", [{}, BOB], ids=["no-salt", "salt"])
def test_an_expired_session_is_not_continued_from_nothing(client, salt):
    before = client.metric("uniradix_sessions_open")
    sid = client.open(**salt)
    client.gen(input_ids=A, rid="t1", session_params={"id": sid}, **salt)
    assert client.open(session_id=sid, timeout=0.2, **salt) == sid   # its turn done: now it may expire
    deadline = time.monotonic() + 120   # only catches a hang: expiry is awaited, not timed
    while client.metric("uniradix_sessions_open") != before:
        assert time.monotonic() < deadline, "the idle session never expired"
        time.sleep(0.1)
    _refused(client, sid, session_params={"id": sid}, **salt)
    _refused(client, sid, session_params={"id": sid, "rid": "t1"}, **salt)
    assert client.metric("uniradix_sessions_open") == before   # not reopened
    assert client.post("/close_session", {"session_id": sid, **salt})[1]["closed"] is False


def test_the_runner_keeps_two_tenants_sessions_of_one_id_apart(make_engine):
    """Below HTTP: the tree's references and the runner's sessions key by (salt, id), and
    the request log's close line says whose session closed (by the salt's digest, which
    `uniradix simulate` closes by)."""
    class Log:
        def __init__(self):
            self.events = []

        def write(self, req, client_id):
            pass

        def event(self, kind, **fields):
            self.events.append((kind, fields))
    eng, log = make_engine(), Log()
    runner = EngineRunner(eng, request_log=log)
    loop = asyncio.new_event_loop()

    def run(ids, sid, salt, continuation=False):
        s = Stream(Request(input_ids=ids, sampling=SamplingParams(max_new_tokens=3), session_id=sid, salt=salt),
                   loop, record=continuation)
        assert eng.prepare(s.req) is None and runner.admit(1, 100)
        runner._handle("submit", s)
        while not s.req.done:
            eng.step()
            runner._emit()
    try:
        for salt, ids in (("a", A), ("b", B)):
            run(ids, "s", salt)
        tree = eng.cache.tree
        # a continuation whose session closed after its context was read runs outside
        # it: it neither reopens the session nor leaves it a reference
        run(C, "gone", "a", continuation=True)
        assert not runner.sessions.is_open("gone", "a") and session_key("gone", "a") not in tree.sessions
        assert session_key("s", "a") in tree.sessions and session_key("s", "b") in tree.sessions
        assert runner.sessions.is_open("s", "a") and runner.sessions.is_open("s", "b")
        assert not runner.sessions.is_open("s") and not runner.close_session("s")
        assert runner.close_session("s", "b")
        assert log.events == [("close_session", {"session": "s", "salt": salt_digest("b")})]
        assert session_key("s", "a") in tree.sessions and session_key("s", "b") not in tree.sessions
        assert runner.sessions.is_open("s", "a") and not runner.sessions.is_open("s", "b")
        assert runner.close_session("s", "a") and not tree.sessions
    finally:
        loop.close()
