"""The three generation routes' bodies are pydantic models (server/bodies.py): a bad body
is a 400 whose message names the field, in the server's error shape (never FastAPI's
422); the defaults are the ones the routes always had; compat.py still sorts SGLang's
fields (used, ignored, neutral-only, unknown); and the server serves the models as its
OpenAPI schema at /openapi.json, with FastAPI's page of it at /docs."""
from __future__ import annotations

import logging

import pytest

from uniradix.server.bodies import ChatRequest, CompletionRequest, GenerateRequest, SGLangSampling
from uniradix.server.compat import GENERATE_IGNORED, GENERATE_NEUTRAL, GENERATE_USED, SAMPLING_NEUTRAL, SAMPLING_USED
from uniradix.server.protocol import BadRequest, parse_chat, parse_completion, parse_generate

EOS = (2,)
CHAT = [{"role": "user", "content": "hi"}]


def generate(body):
    return parse_generate(body, EOS, 8)


def completion(body):
    return parse_completion(body, EOS, 8)


def chat(body):
    return parse_chat(body, EOS)


# (body, the start of the message: the field it names)
BAD_GENERATE = [
    ([1, 2], "the request body must be a JSON object"),
    ({"text": 5}, "text must be a string"),
    ({"text": ["a", 5]}, "text[1] must be a string"),
    ({"input_ids": "abc"}, "input_ids must be a list of token ids"),
    ({"input_ids": [1, True]}, "input_ids[1] must be an int"),
    ({"input_ids": [1, 2.0]}, "input_ids[1] must be an int"),
    ({"input_ids": [[1], [2, "x"]]}, "input_ids[1][1] must be an int"),
    ({"input_ids": [1, -2]}, "input_ids[1] must be >= 0"),
    ({"text": "a", "input_ids": [1]}, "give exactly one of text or input_ids"),
    ({"sampling_params": {}}, "give exactly one of text or input_ids"),
    ({"text": "a", "stream": 1}, "stream must be true or false"),
    ({"text": "a", "stream": None}, "stream must be true or false"),
    ({"text": "a", "priority": True}, "priority must be an int"),
    ({"text": "a", "session_id": ""}, "session_id must be a non-empty string"),
    ({"text": "a", "session_id": 1.5}, "session_id must be a non-empty string or an int"),
    ({"text": "a", "rid": ["x"]}, "rid: a list is for a batch"),
    ({"text": ["a", "b"], "rid": ["x"]}, "rid: 1 given for 2 prompts"),
    ({"text": ["a", "b"], "extra_key": ["x", 5]}, "extra_key[1] must be a string"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"top_k": 0}]}, "sampling_params[1].top_k must be -1"),
    ({"text": "a", "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature must be >= 0"),
    ({"text": "a", "sampling_params": {"temperature": 1e400}}, "sampling_params.temperature must be a finite"),
    ({"text": "a", "sampling_params": {"temperature": 10 ** 400}}, "sampling_params.temperature must be a number"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params.top_p must be > 0"),
    ({"text": "a", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p must be <= 1"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens must be >= 1"),
    ({"text": "a", "sampling_params": {"max_new_tokens": True}}, "sampling_params.max_new_tokens must be an int"),
    ({"text": "a", "sampling_params": {"seed": 2 ** 63}}, "sampling_params.seed must be < "),
    ({"text": "a", "sampling_params": {"stop": ""}}, "sampling_params.stop must be a non-empty string"),
    ({"text": "a", "sampling_params": {"stop": ["x"] * 65}}, "sampling_params.stop must hold at most 64 items"),
    ({"text": "a", "sampling_params": {"stop": "x" * 1025}}, "sampling_params.stop must hold at most 1024 char"),
    ({"text": "a", "sampling_params": {"stop_token_ids": 7}}, "sampling_params.stop_token_ids must be a list"),
    ({"text": "a", "sampling_params": {"skip_special_tokens": None}}, "sampling_params.skip_special_tokens must"),
    ({"text": "a", "sampling_params": {"min_p": 0.1}},
     "sampling_params.min_p=0.1 is not supported (only 0 or 0.0 or null)"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"n": 2}]}, "sampling_params[1].n=2 is not supported"),
    ({"text": "a", "return_hidden_states": True}, "return_hidden_states=True is not supported"),
    ({"text": "a", "lora_path": ["a", None]}, "lora_path=['a', None] is not supported"),
    ({"text": "a", "modalities": ["image"]}, "modalities must be null or empty"),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num must be an int in [0, 20]"),
    ({"text": ["a", "b"], "return_logprob": [False, True], "top_logprobs_num": [0, 99]},
     "top_logprobs_num[1] must be an int in [0, 20]"),
    ({"text": "a", "return_text_in_logprobs": "yes"}, "return_text_in_logprobs must be true or false"),
    ({"text": "a", "session_params": []}, "session_params must be an object"),
    ({"text": "a", "session_params": {}}, "session_params.id is required"),
    ({"text": "a", "session_params": {"id": "s", "offset": -1}}, "session_params.offset must be >= 0"),
    ({"text": "a", "session_params": {"id": "s", "color": 1}}, "session_params: unknown field(s) ['color']"),
    ({"text": "a", "session_params": {"id": "s", "replace": True}}, "session_params.replace: "),
    ({"text": "a", "session_params": {"id": "s"}, "session_id": "s"}, "give session_id or session_params"),
    ({"text": ["a", "b"], "session_params": {"id": "s"}}, "session_params continues one conversation"),
    ({"text": ["a"] * 9}, "a batch holds 1 to 8 prompts, got 9"),
    ({"text": []}, "a batch holds 1 to 8 prompts, got 0"),
]

BAD_COMPLETION = [
    ("x", "the request body must be a JSON object"),
    ({}, "prompt is required"),
    ({"prompt": None}, "prompt must be a string, a list of strings, a list of token ids"),
    ({"prompt": []}, "prompt must be a string, a list of strings, a list of token ids"),
    ({"prompt": [True]}, "prompt must be a string, a list of strings, a list of token ids"),
    ({"prompt": [1, "a"]}, "prompt[1] must be an int"),
    ({"prompt": [[1], "a"]}, "prompt[1] must be a list"),
    ({"prompt": ["a"] * 9}, "a batch holds 1 to 8 prompts, got 9"),
    ({"prompt": "a", "model": 5}, "model must be a string"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"prompt": "a", "max_tokens": 2.0}, "max_tokens must be an int"),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop must hold at most 4 items"),
    ({"prompt": "a", "stop_token_ids": [1, None]}, "stop_token_ids[1] must be an int"),
    ({"prompt": "a", "ignore_eos": 1}, "ignore_eos must be true or false"),
    ({"prompt": "a", "top_k": 0}, "top_k must be -1"),
    ({"prompt": "a", "n": 2}, "n=2 is not supported (only 1 or None)"),
    ({"prompt": "a", "best_of": 3}, "best_of=3 is not supported"),
    ({"prompt": "a", "logit_bias": {"5": 1}}, "logit_bias={'5': 1} is not supported"),
    ({"prompt": "a", "suffix": "end"}, "suffix='end' is not supported"),
    ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty=0.5 is not supported"),
    ({"prompt": "a", "logprobs": True}, "logprobs must be an int"),
    ({"prompt": "a", "logprobs": 21}, "logprobs must be <= 20"),
    ({"prompt": "a", "echo": "yes"}, "echo must be true or false"),
    ({"prompt": "a", "echo": True, "stream": True}, "echo with stream is not supported"),
    ({"prompt": ["a", "b"], "stream": True}, "stream with more than one prompt is not supported"),
    ({"prompt": "a", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage must be true"),
    ({"prompt": "a", "stream_options": 3}, "stream_options must be an object"),
    ({"prompt": "a", "cache_salt": 5}, "cache_salt must be a string"),
]

BAD_CHAT = [
    ({}, "messages is required"),
    ({"messages": []}, "messages must hold at least 1 item"),
    ({"messages": "hi"}, "messages must be a list"),
    ({"messages": ["hi"]}, "messages[0] must be an object"),
    ({"messages": [{"content": "x"}]}, "messages[0].role is required"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be 'system', 'developer'"),
    ({"messages": [CHAT[0], {"role": "user"}]}, "messages[1].content must be a string or a list of text parts"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content must be a string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type must be"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text must be a string"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens must be >= 1"),
    ({"messages": CHAT, "temperature": "hot"}, "temperature must be a number"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools=[{'type': 'function'}] is not supported"),
    ({"messages": CHAT, "tool_choice": "required"}, "tool_choice='required' is not supported"),
    ({"messages": CHAT, "response_format": {"type": "json_object"}}, "response_format.type must be 'text'"),
    ({"messages": CHAT, "logprobs": 1}, "logprobs must be true or false"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs must be <= 20"),
    ({"messages": CHAT, "session_id": [1]}, "session_id must be a non-empty string or an int"),
]


@pytest.mark.parametrize("parse,body,start", [(generate, b, s) for b, s in BAD_GENERATE]
                         + [(completion, b, s) for b, s in BAD_COMPLETION] + [(chat, b, s) for b, s in BAD_CHAT],
                         ids=lambda v: v.__name__ if callable(v) else None)
def test_a_bad_body_is_a_400_naming_the_field(parse, body, start):
    with pytest.raises(BadRequest) as e:
        parse(body)
    assert e.value.status == 400
    assert e.value.message.startswith(start), e.value.message


def test_the_models_declare_the_fields_compat_says_are_used():
    """compat.py's `used` tables are what the models declare: a field in one and not the
    other would be read without being sorted, or sorted without being read."""
    assert set(GenerateRequest.model_fields) == GENERATE_USED
    assert set(SGLangSampling.model_fields) == SAMPLING_USED


def test_the_defaults_are_the_routes_own():
    (job,), batched, stream = generate({"text": "a"})
    s = job.req.sampling
    assert (batched, stream, s.max_new_tokens, s.fit_context, s.temperature, s.top_p, s.top_k) == \
        (False, False, 128, True, 1.0, 1.0, -1)
    assert s.stop_ids == EOS and job.skip_special_tokens and not job.no_stop_trim and job.req.logprobs is None
    (job,), stream, usage = completion({"prompt": [5, 6]})
    assert job.req.input_ids == [5, 6] and job.req.sampling.max_new_tokens == 16 and (stream, usage) == (False, False)
    messages, s, stream, usage, sid, salt, lp = chat({"messages": [{"role": "assistant"}, *CHAT]})
    assert messages == [{"role": "assistant", "content": ""}, *CHAT]
    assert (s.max_new_tokens, s.fit_context, s.temperature, stream, usage, sid, salt, lp) == \
        (128, True, 1.0, False, False, None, None, None)


def test_what_the_routes_always_accepted_they_still_do():
    jobs, batched, _ = generate({"text": ["a", "b"], "rid": "job", "sampling_params": {"seed": None, "sampling_seed": 3,
                                                                                      "ignore_eos": True},
                                 "return_logprob": [True, False], "top_logprobs_num": [2, 99],
                                 "lora_path": [None, ""], "log_metrics": True, "modalities": [None]})
    assert batched and [j.rid for j in jobs] == ["job_0", "job_1"] and [j.req.logprobs for j in jobs] == [2, None]
    assert jobs[0].req.sampling.seed is None and jobs[0].req.sampling.stop_ids == ()  # an explicit seed wins
    (job,), _, _ = generate({"input_ids": [5], "sampling_params": {"sampling_seed": 3, "stop": "x"},
                             "cache_salt": "t", "extra_key": ""})
    assert job.req.sampling.seed == 3 and job.stop == ("x",) and job.req.salt == '[null, "t"]'
    (job,), stream, usage = completion({"prompt": "a", "n": 1.0, "presence_penalty": 0.0, "logprobs": False,
                                        "echo": None, "stream_options": False, "user": "u"})
    assert job.req.logprobs is None and not job.echo and (stream, usage) == (False, False)
    (job,), stream, usage = completion({"prompt": "a", "logprobs": 0, "echo": True,
                                        "stream_options": {"include_usage": True}})
    assert job.req.logprobs == 0 and job.req.prompt_logprobs_from == 0 and job.echo and usage
    messages, s, *_, lp = chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}],
                                "max_completion_tokens": 7, "max_tokens": 3, "logprobs": True, "tool_choice": "auto",
                                "tools": [], "response_format": {"type": "text"}})
    assert messages == [{"role": "user", "content": "ab"}] and s.max_new_tokens == 7 and lp == 0


def test_neutral_values_pass_and_the_others_name_the_field_and_value():
    tables = {**GENERATE_NEUTRAL, **{f"sampling_params.{k}": v for k, v in SAMPLING_NEUTRAL.items()}}
    for name, allowed in tables.items():
        *outer, field = name.split(".")
        for value in allowed:
            body = {"text": "a", **({"sampling_params": {field: value}} if outer else {field: value})}
            assert generate(body)[0], body
        body = {"text": "a", **({"sampling_params": {field: "on"}} if outer else {field: "on"})}
        with pytest.raises(BadRequest) as e:
            generate(body)
        assert e.value.message.startswith(f"{name}='on' is not supported"), e.value.message


def test_ignored_fields_pass_silently_and_unknown_ones_warn_once(caplog):
    body = {"text": "a", **{k: "anything" for k in GENERATE_IGNORED}}
    with caplog.at_level(logging.WARNING, logger="uniradix.server"):
        generate(body)
        for _ in range(2):
            generate({"text": "a", "zz_models_test_field": 1, "sampling_params": {"zz_models_test_knob": 1}})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "/generate: ignoring the unknown field 'zz_models_test_field'" in lines[0]
    assert "/generate sampling_params: ignoring the unknown field 'zz_models_test_knob'" in lines[1]


# ---------------------------------------------------------------------------- over HTTP
ROUTES = {"/generate": ("GenerateRequest", {"text", "input_ids", "sampling_params", "rid", "stream", "session_params"}),
          "/v1/completions": ("CompletionRequest", {"prompt", "max_tokens", "temperature", "logprobs", "echo", "n"}),
          "/v1/chat/completions": ("ChatRequest", {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                                   "tools", "stream_options"})}


def test_openapi_json_declares_the_three_bodies(server):
    status, doc, headers = server.get("/openapi.json")
    assert status == 200 and headers["content-type"].startswith("application/json"), doc
    assert doc["openapi"].startswith("3.") and doc["info"]["title"] == "uniradix"
    schemas = doc["components"]["schemas"]
    for path, (name, fields) in ROUTES.items():
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert fields <= set(schemas[name]["properties"]), (name, sorted(schemas[name]["properties"]))
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/Error"
    assert set(schemas["SGLangSampling"]["properties"]) >= SAMPLING_USED | set(SAMPLING_NEUTRAL)
    assert schemas["GenerateRequest"]["properties"]["lora_path"]["enum"] == [None, "", []]
    assert schemas["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0] == {"minimum": 1, "type": "integer"}
    assert set(schemas["Error"]["properties"]["error"]["required"]) == {"message", "type", "code"}
    # every $ref resolves, and no route claims FastAPI's 422: the server answers 400
    refs = set()

    def walk(x):
        if isinstance(x, dict):
            if "$ref" in x:
                refs.add(x["$ref"].rsplit("/", 1)[1])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(doc)
    assert refs <= set(schemas), refs - set(schemas)
    assert all("422" not in op.get("responses", {}) for p in doc["paths"].values() for op in p.values())
    assert {"/health", "/v1/models", "/tokenize", "/metrics"} <= set(doc["paths"])
    ids = [op["operationId"] for p in doc["paths"].values() for op in p.values()]
    assert len(ids) == len(set(ids)), ids  # /flush_cache's GET and POST are two operations


def test_openapi_json_is_a_valid_openapi_document(server):
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(server.get("/openapi.json")[1])


def test_docs_is_the_page_of_the_schema(server):
    status, page, headers = server.get("/docs")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "swagger" in page.lower() and "/openapi.json" in page


@pytest.mark.parametrize("path,body,start", [
    ("/generate", {"text": "a", "sampling_params": {"top_p": 2}}, "sampling_params.top_p must be <= 1"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"regex": "a+"}]},
     "sampling_params[1].regex='a+' is not supported"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, "max_tokens must be an int"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be"),
])
def test_over_http_a_bad_body_is_a_400_in_the_error_shape(server, path, body, start):
    status, out, _ = server.post(path, {"model": "tiny-hybrid", **body} if path != "/generate" else body)
    assert status == 400, out
    assert set(out) == {"error"} and out["error"]["type"] == "BadRequestError" and out["error"]["code"] == 400
    assert out["error"]["message"].startswith(start), out


def test_over_http_neutral_and_ignored_fields_are_served(server):
    status, out, _ = server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "min_p": 0,
                                                                               "stream_interval": 5},
                                               "lora_path": None, "routing_key": "r", "return_hidden_states": False})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2, out
    status, out, _ = server.post("/v1/chat/completions", {"model": "tiny-hybrid", "messages": CHAT, "max_tokens": 2,
                                                          "n": 1, "tools": [], "user": "u"})
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out


def test_the_models_validate_as_pydantic_models():
    """What a caller of the models (a client library, a test) gets: typed fields."""
    r = ChatRequest.model_validate({"messages": CHAT, "temperature": 0})
    assert r.temperature == 0.0 and isinstance(r.temperature, float) and r.top_k == -1 and r.stream is False
    assert CompletionRequest.model_validate({"prompt": [[1], [2]]}).prompt == [[1], [2]]
