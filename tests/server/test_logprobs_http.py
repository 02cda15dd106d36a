"""Output logprobs over HTTP in each API's shape: SGLang's meta_info lists, OpenAI's
completions and chat objects, streamed chunk by chunk too. A request served from the
cache gives the logprobs its uncached twin gave (within the logits' tolerance)."""
from __future__ import annotations

import pytest

PROMPT = "the same words, so that the second request reuses them: " * 3


def _generate(server, **fields):
    status, out, _ = server.post("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 6,
                                                                                    "temperature": 0}, **fields})
    assert status == 200, out
    return out


def test_generate_logprobs_and_reuse(server):
    server.post("/flush_cache")
    a = _generate(server, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)
    b = _generate(server, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)
    assert a["meta_info"]["cached_tokens"] == 0 and b["meta_info"]["cached_tokens"] > 0
    for out in (a, b):
        lps, tops = out["meta_info"]["output_token_logprobs"], out["meta_info"]["output_top_logprobs"]
        assert [tok for _, tok, _ in lps] == out["output_ids"] and len(tops) == len(lps) == 6
        for (lp, tok, text), top in zip(lps, tops):
            assert lp <= 0 and isinstance(text, str) and len(top) == 2 and top[0][0] >= top[1][0]
            assert tok == top[0][1] and lp == pytest.approx(top[0][0])   # greedy: the likeliest
    for (x, _, _), (y, _, _) in zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]):
        assert x == pytest.approx(y, abs=1e-4)
    plain = _generate(server)
    assert "output_token_logprobs" not in plain["meta_info"]
    no_text = _generate(server, return_logprob=True)
    assert all(text is None for _, _, text in no_text["meta_info"]["output_token_logprobs"])
    assert all(top == [] for top in no_text["meta_info"]["output_top_logprobs"])


def test_completion_logprobs(server):
    status, out, _ = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                                     "logprobs": 3})
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    # {text: logprob}: ids whose texts coincide (bytes that are no UTF-8 alone) share an entry, as in vLLM
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert lp["text_offset"][1] == len(lp["tokens"][0])
    status, out, _ = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert out["choices"][0]["logprobs"] is None


def test_chat_logprobs_whole_and_streamed(server):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    status, out, _ = server.post("/v1/chat/completions", body)
    assert status == 200, out
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode())
                                     for c in content)
    streamed = []
    for event in server.stream("/v1/chat/completions", {**body, "stream": True}):
        if event != "[DONE]" and event["choices"] and event["choices"][0]["logprobs"]:
            streamed += event["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in streamed] == [c["token"] for c in content]
    assert [c["logprob"] for c in streamed] == pytest.approx([c["logprob"] for c in content], abs=1e-4)


def test_prompt_logprobs_on_generate_and_echo(server):
    """SGLang's logprob_start_len and OpenAI's echo with logprobs: the prompt tokens'
    logprobs, recomputed even where the cache holds the prompt (the second request
    gets what the first computed)."""
    got = []
    for _ in range(2):
        out = _generate(server, return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        got.append(out["meta_info"])
    for m in got:
        ins, tops = m["input_token_logprobs"], m["input_top_logprobs"]
        assert len(ins) == m["prompt_tokens"] == len(tops)
        assert ins[0][0] is None and tops[0] is None and all(lp <= 0 for lp, _, _ in ins[1:])
        assert all(len(t) == 1 for t in tops[1:])
    assert [x for x, _, _ in got[0]["input_token_logprobs"][1:]] == pytest.approx(
        [x for x, _, _ in got[1]["input_token_logprobs"][1:]], abs=1e-4)
    status, out, _ = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                     "echo": True, "logprobs": 1})
    assert status == 200, out
    c = out["choices"][0]
    assert c["text"].startswith(PROMPT)
    lp = c["logprobs"]
    n = out["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"][:n]) == PROMPT
    assert lp["token_logprobs"][1:n] == pytest.approx([x for x, _, _ in got[0]["input_token_logprobs"][1:]],
                                                      abs=1e-4)
