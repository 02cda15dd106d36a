"""OpenAI's API: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (the model's
chat template; a plain role-per-line format for models without one), whole or
streamed, with `usage.prompt_tokens_details.cached_tokens`. `session_id` is accepted as
an extra field, as SGLang does. `model` names one of the served names (404 otherwise, as
vLLM answers); the answers give the first."""
from __future__ import annotations

import json
import time

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from ..engine import Request
from .bodies import ChatRequest, CompletionRequest, request_body
from .jobs import Jobs, check_outcome, new_id, openai_finish, usage
from .logprobs import chat_logprobs, completion_logprobs
from .offload import json_off_loop, off_loop
from .protocol import Job, chat_count_field, parse_chat, parse_completion


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's ids; without a template, "role: content" lines and an open
    assistant line."""
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.encode_chat(messages)
        except Exception as e:  # the template refused the conversation (raise_exception)
            from .protocol import BadRequest
            raise BadRequest(f"messages: the chat template refused them: {e}") from None
    return tokenizer.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")


#: the engine's field names -> what an OpenAI client sent
COMPLETION_NAMES = {"input_ids": "prompt", "max_new_tokens": "max_tokens", "stop_ids": "stop_token_ids"}
CHAT_NAMES = {"input_ids": "messages", "max_new_tokens": "max_tokens", "stop_ids": "stop_token_ids"}


#: what /v1/models says owns the model: "sglang", since this server speaks SGLang's
#: API, and SGLang's gateway (smg) classifies a worker by it (then reads /server_info
#: and /model_info, SGLang's, rather than vLLM's routes)
OWNED_BY = "sglang"


def add_routes(app, jobs: Jobs, read_body) -> None:
    name = app.state.model_name
    max_batch = app.state.config.max_batch_prompts

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": app.state.started,
                                            "owned_by": OWNED_BY, "max_model_len": jobs.engine.context_length}
                                           for n in app.state.served_names]}

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: HTTPRequest):
        body = await read_body(request)
        batch, stream, include_usage = await off_loop(parse_completion, body, jobs.eos(), max_batch)
        app.state.check_model(body)
        return await _respond(request, jobs, batch, stream, include_usage, "text_completion", name, COMPLETION_NAMES)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatRequest))
    async def chat(request: HTTPRequest):
        body = await read_body(request)
        messages, sampling, stream, include_usage, sid, salt, lp = await off_loop(parse_chat, body, jobs.eos())
        app.state.check_model(body)
        ids = await off_loop(chat_prompt, jobs.tokenizer, messages)
        job = Job(Request(input_ids=ids, sampling=sampling, session_id=sid, salt=salt, logprobs=lp), sampling.stop,
                  logprobs=lp is not None)
        names = {**CHAT_NAMES, "max_new_tokens": chat_count_field(body)}
        return await _respond(request, jobs, [job], stream, include_usage, "chat.completion", name, names)


async def _respond(request, jobs: Jobs, batch: list[Job], stream: bool, include_usage: bool, kind: str, name: str,
                   names: dict):
    rid = new_id("chatcmpl-" if kind == "chat.completion" else "cmpl-")
    for i, j in enumerate(batch):  # the log names each prompt by the response's id
        j.rid = j.rid or (rid if len(batch) == 1 else f"{rid}-{i}")
    streams = await jobs.start(batch, names)
    created = int(time.time())
    if stream:
        return StreamingResponse(_sse(jobs, batch[0], streams[0], include_usage, kind, rid, created, name, request),
                                 media_type="text/event-stream")
    outs = await jobs.finish(batch, streams, request)
    check_outcome(batch)
    # the answer (an echoed prompt's text, logprobs' texts) is built and serialized off the loop
    return await json_off_loop(_answer, jobs, batch, outs, kind, rid, created, name)


def _answer(jobs: Jobs, batch: list[Job], outs, kind: str, rid: str, created: int, name: str) -> dict:
    choices = []
    for i, (job, out) in enumerate(zip(batch, outs)):
        c = {"index": i, "finish_reason": openai_finish(job.req), "logprobs": None}
        if job.logprobs:
            c["logprobs"] = (chat_logprobs(job.req, jobs.tokenizer) if kind == "chat.completion"
                             else completion_logprobs(job.req, jobs.tokenizer, echo=job.echo))
        if kind == "chat.completion":
            c["message"] = {"role": "assistant", "content": out.shown}
        else:
            prompt = (job.req.text if job.req.text is not None else jobs.tokenizer.decode(job.req.input_ids)) \
                if job.echo else ""
            c["text"] = prompt + out.shown
        choices.append(c)
    return {"id": rid, "object": kind, "created": created, "model": name, "choices": choices,
            "usage": usage([j.req for j in batch])}


async def _sse(jobs: Jobs, job: Job, s, include_usage: bool, kind: str, rid: str, created: int, name: str,
               request):
    chat = kind == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    out = jobs.text_out(job)

    sent = [0, 0]  # output tokens whose logprobs went out, and the text length before them

    def logprobs(upto: int | None):
        """The logprobs of the tokens not yet sent, up to `upto` (None: all): a chunk
        carries those of the tokens that arrived since the last chunk."""
        if not job.logprobs:
            return None
        end = len(job.req.output_logprobs) if upto is None else upto
        if chat:
            lp = chat_logprobs(job.req, jobs.tokenizer, sent[0], end)
        else:
            lp = completion_logprobs(job.req, jobs.tokenizer, sent[0], end, sent[1])
            sent[1] += sum(len(t) for t in lp["tokens"])
        sent[0] = end
        return lp

    def chunk(delta: str | None, finish, usage_=None, role: bool = False, upto: int | None = -1) -> str:
        lp = None if upto == -1 else logprobs(upto)
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": lp}
        body = {"id": rid, "object": obj, "created": created, "model": name,
                "choices": [] if usage_ is not None else [choice]}
        if usage_ is not None:
            body["usage"] = usage_
        return f"data: {json.dumps(body)}\n\n"

    finished = False
    with jobs.streaming(request, lambda: [] if finished else [job.req]):  # aborts it if the stream stops early
        if chat:
            yield chunk(None, None, role=True)
        while not finished:
            ids, finished = await s.get()
            delta = out.delta(ids, finished)
            if delta:
                yield chunk(delta, None, upto=len(out.ids))
        yield chunk(None, openai_finish(job.req), upto=None)
        if include_usage:
            yield chunk(None, None, usage([job.req]))
        yield "data: [DONE]\n\n"
