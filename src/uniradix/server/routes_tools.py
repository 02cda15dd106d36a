"""The small routes clients of SGLang and vLLM expect beside generation: `/tokenize` and
`/detokenize` in both servers' shapes, and `/version` (vLLM's `/reset_prefix_cache` is
the cache flush, routes_admin.py's). Everything after reading the body (checks,
tokenizing, the answer's JSON) runs off the event loop (offload.py)."""
from __future__ import annotations

from fastapi import Request as HTTPRequest

from .offload import json_off_loop
from .protocol import BadRequest, want


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    want(isinstance(v, bool), name, "true or false", v)
    return v


def add_routes(app, jobs, read_body, check_model, version: str) -> None:
    tokenizer = jobs.tokenizer

    @app.get("/version")
    async def version_route():
        return {"version": version}

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        """vLLM's ({"prompt": str} or {"messages": [...]}) and SGLang's ({"prompt": str or
        a list of them}): {"tokens", "count", "max_model_len"} (lists of them for a list
        of prompts)."""
        return await json_off_loop(tokenize_body, await read_body(request))

    def tokenize_body(body) -> dict:
        want(isinstance(body, dict), "the request body", "a JSON object", type(body).__name__)
        check_model(body)
        special = _flag(body, "add_special_tokens", True)
        limit = jobs.engine.context_length
        if body.get("messages") is not None:
            from .protocol import parse_chat
            from .routes_openai import chat_prompt
            messages = parse_chat({"messages": body["messages"]}, jobs.eos())[0]
            ids = chat_prompt(tokenizer, messages)
            return {"tokens": ids, "count": len(ids), "max_model_len": limit}
        prompt = body.get("prompt", body.get("text"))
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt, add_special_tokens=special)
            return {"tokens": ids, "count": len(ids), "max_model_len": limit}
        want(isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt), "prompt",
             "a string or a non-empty list of strings (or messages)", prompt)
        ids = [tokenizer.encode(p, add_special_tokens=special) for p in prompt]
        return {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": limit}

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        """{"tokens": [ids]} -> the text, as vLLM (`prompt`) and SGLang (`text`) name it;
        a list of such lists gives a list of texts."""
        return await json_off_loop(detokenize_body, await read_body(request))

    def detokenize_body(body) -> dict:
        want(isinstance(body, dict), "the request body", "a JSON object", type(body).__name__)
        check_model(body)
        tokens = body.get("tokens")
        vocab = jobs.engine.model.vocab_size
        batched = isinstance(tokens, list) and bool(tokens) and isinstance(tokens[0], list)
        for seq in (tokens if batched else [tokens]):
            want(isinstance(seq, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in seq),
                 "tokens", "a list of token ids (or a list of such lists)", seq)
            bad = [t for t in seq if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"tokens: {bad[0]} is not a token id of this model (0 to {vocab - 1})")
        skip = _flag(body, "skip_special_tokens", True)
        texts = [tokenizer.decode(seq, skip_special_tokens=skip) for seq in (tokens if batched else [tokens])]
        text = texts if batched else texts[0]
        return {"prompt": text, "text": text}
