"""SGLang's session continuation: the server keeps each finished turn of a session, and
a request that names one (`session_params.rid`, default the latest) sends only its new
tokens; its prompt is that turn's prompt and output (its prompt alone with
drop_previous_output), cut at `offset`, then the new tokens. Exact against sending the
whole conversation; the forms not implemented are a 400, never a silent drop."""
from __future__ import annotations

A = list(range(30, 70))
B = list(range(100, 112))
C = list(range(140, 146))
SP = {"max_new_tokens": 5, "temperature": 0}


def _gen(server, **fields):
    status, out, _ = server.post("/generate", {"sampling_params": SP, **fields})
    assert status == 200, out
    return out


def test_a_continuation_equals_the_whole_conversation(server):
    status, sid, _ = server.post("/open_session", {})
    assert status == 200, sid
    t1 = _gen(server, input_ids=A, rid="t1", session_params={"id": sid})
    assert t1["meta_info"]["id"] == "t1" and t1["meta_info"]["prompt_tokens"] == len(A)
    t2 = _gen(server, input_ids=B, rid="t2", session_params={"id": sid, "rid": "t1"})
    whole = _gen(server, input_ids=A + t1["output_ids"] + B)
    assert t2["output_ids"] == whole["output_ids"]
    assert t2["meta_info"]["prompt_tokens"] == len(A) + 5 + len(B) and t2["meta_info"]["cached_tokens"] > 0
    latest = _gen(server, input_ids=C, session_params={"id": sid})          # no rid: the latest turn (t2)
    assert latest["meta_info"]["prompt_tokens"] == len(A) + 5 + len(B) + 5 + len(C)
    assert latest["output_ids"] == _gen(server, input_ids=A + t1["output_ids"] + B + t2["output_ids"] + C)["output_ids"]
    cut = _gen(server, input_ids=C, session_params={"id": sid, "rid": "t1", "offset": 3})
    assert cut["output_ids"] == _gen(server, input_ids=A[:3] + C)["output_ids"]
    dropped = _gen(server, input_ids=C, session_params={"id": sid, "rid": "t1", "drop_previous_output": True})
    assert dropped["meta_info"]["prompt_tokens"] == len(A) + len(C)
    assert dropped["output_ids"] == _gen(server, input_ids=A + C)["output_ids"]
    text = _gen(server, text="and then?", session_params={"id": sid, "rid": "t1"})   # text: its tokens appended
    assert text["meta_info"]["prompt_tokens"] == len(A) + 5 + len("and then?")
    assert server.post("/close_session", {"session_id": sid})[0] == 200
    status, out, _ = server.post("/generate", {"input_ids": C, "sampling_params": SP,
                                               "session_params": {"id": sid, "rid": "t1"}})
    assert status == 404 and sid in out["error"]["message"], out   # closed: it and its turns are gone


def test_the_forms_not_implemented_are_refused(server):
    assert server.post("/open_session", {"session_id": "s"})[0] == 200
    for fields, word in (({"session_params": {"id": "s", "rid": "nope"}}, "nope"),
                         ({"session_params": {"id": "s", "replace": True}}, "replace"),
                         ({"session_params": {"id": "s"}, "session_id": "s"}, "not both"),
                         ({"session_params": {"id": "s", "offset": -1}}, "offset"),
                         ({"session_params": {"id": "s", "color": 1}}, "color"),
                         ({"session_params": {"id": 5}}, "session_params.id")):
        status, out, _ = server.post("/generate", {"input_ids": C, "sampling_params": SP, **fields})
        assert status == 400 and word in out["error"]["message"], (fields, out)
    status, out, _ = server.post("/generate", {"input_ids": [C, C], "sampling_params": SP,
                                               "session_params": {"id": "s"}})
    assert status == 400 and "one prompt" in out["error"]["message"], out
