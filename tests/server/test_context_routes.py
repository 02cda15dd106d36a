"""The context length over HTTP: every generation route, streaming or not, one prompt
or a batch, refuses a request that asks for more than the context with a 400 naming
both lengths (in the API's own field names); a request that names no count gets the
room that is left; the context is reported where clients look for it."""
import pytest
from server_proc import ServerProc

CTX = 64


@pytest.fixture(scope="module")
def srv():
    s = ServerProc("--context-length", str(CTX), "--max-total-tokens", "2048", "--max-running-requests", "4")
    yield s
    assert s.stop() == 0, "".join(s.lines[-30:])


def ids(n: int) -> list[int]:
    return [3 + i % 200 for i in range(n)]


def refused(srv, path, body, *fragments):
    code, out, _ = srv.post(path, body)
    assert code == 400, out
    msg = out["error"]["message"]
    assert all(f in msg for f in fragments), msg
    return msg


OVER = [
    ("/generate", {"input_ids": ids(60), "sampling_params": {"max_new_tokens": 5}}, "max_new_tokens"),
    ("/generate", {"input_ids": ids(60), "stream": True, "sampling_params": {"max_new_tokens": 5}},
     "max_new_tokens"),
    ("/v1/completions", {"prompt": ids(60), "max_tokens": 5}, "max_tokens"),
    ("/v1/completions", {"prompt": ids(60), "max_tokens": 5, "stream": True}, "max_tokens"),
]


@pytest.mark.parametrize("path,body,field", OVER, ids=[f"{p}-{b.get('stream', False)}" for p, b, _ in OVER])
def test_a_count_past_the_context_is_400_naming_both_lengths(srv, path, body, field):
    refused(srv, path, body, "the prompt is too long", f"60 prompt tokens + 5 {field} = 65 tokens", f"{CTX} tokens")


def test_chat_and_batches_are_refused_too(srv):
    long = "x" * 70  # the embedded model's byte tokenizer: one token a byte
    for stream in (False, True):
        refused(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}], "max_tokens": 4,
                                              "stream": stream}, "prompt tokens", f"{CTX} tokens")
    refused(srv, "/generate", {"input_ids": [ids(10), ids(62)], "sampling_params": {"max_new_tokens": 3}},
            "prompt 1", "62 prompt tokens + 3 max_new_tokens = 65 tokens")
    refused(srv, "/v1/completions", {"prompt": [ids(10), ids(62)], "max_tokens": 3}, "prompt 1")
    srv.wait_idle()
    assert srv.metrics()["uniradix_prompt_tokens_total"] == 0  # nothing of a refused batch ran


def test_chat_names_the_count_field_the_client_sent(srv):
    """OpenAI's newer max_completion_tokens wins over max_tokens; the refusal names it."""
    long = "x" * 40
    for body, field in (({"max_completion_tokens": 40}, "max_completion_tokens"),
                        ({"max_completion_tokens": 40, "max_tokens": 2}, "max_completion_tokens"),
                        ({"max_completion_tokens": None, "max_tokens": 40}, "max_tokens")):
        for stream in (False, True):
            msg = refused(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}],
                                                        "stream": stream, **body}, f"+ 40 {field} =", f"{CTX} tokens")
            assert "max_new_tokens" not in msg


def test_without_a_count_the_room_left_is_used(srv):
    code, out, _ = srv.post("/v1/completions", {"prompt": ids(60), "temperature": 0})
    assert code == 200 and out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "length"
    code, out, _ = srv.post("/generate", {"input_ids": ids(61), "sampling_params": {"temperature": 0}})
    assert code == 200 and len(out["output_ids"]) == 3
    code, out, _ = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40}],
                                                     "temperature": 0})
    assert code == 200
    assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] == CTX
    refused(srv, "/v1/completions", {"prompt": ids(CTX)}, "no room for a new token", f"{CTX} tokens")


def test_the_context_is_reported(srv):
    assert srv.get("/v1/models")[1]["data"][0]["max_model_len"] == CTX
    assert srv.get("/get_model_info")[1]["context_length"] == CTX
    assert srv.get("/get_server_info")[1]["context_length"] == CTX
