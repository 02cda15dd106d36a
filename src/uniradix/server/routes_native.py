"""SGLang's native `/generate`: one prompt or a batch, text or token ids, whole or
streamed as server-sent events (the cumulative text in each chunk, `data: [DONE]` at
the end), with `meta_info` carrying the cached tokens and their split by tier."""
from __future__ import annotations

import asyncio
import json

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from ..engine.speculation import tokens_a_verify
from .bodies import GenerateRequest, request_body
from .jobs import Jobs, cached_split, check_outcome, finish_reason, new_id
from .logprobs import sglang_meta
from .offload import json_off_loop, off_loop
from .protocol import BadRequest, Job, parse_generate
from .sessions import UnknownSession
from .textout import TextOut


def meta_info(job: Job, out: TextOut, done: bool) -> dict:
    req = job.req
    m = req.metrics
    info = {"id": job.rid, "finish_reason": finish_reason(req) if done else None,
            "prompt_tokens": m.prompt_tokens, "completion_tokens": len(out.ids), "cached_tokens": m.cached_tokens,
            "cached_tokens_details": cached_split(req),
            # of the storage tier's, those from objects another instance wrote (not a tier of its own)
            "cached_tokens_cross_instance": m.cross_instance_tokens}
    if m.spec_verify_ct:  # speculation: verify steps, drafts and drafts kept, and SGLang's newer names
        kept, drafted, verifies = m.spec_accepted_tokens, m.spec_draft_tokens, m.spec_verify_ct
        info.update(spec_verify_ct=verifies, spec_draft_tokens=drafted, spec_accepted_tokens=kept,
                    spec_draft_token_num=drafted, spec_accept_token_num=kept,
                    spec_accept_rate=kept / drafted if drafted else 0.0,
                    spec_accept_length=tokens_a_verify(kept, verifies))
    if done and m.latency is not None:
        info["e2e_latency"] = m.latency
    if job.logprobs:
        info.update(sglang_meta(req, out.tokenizer, job.text_in_logprobs))
    return info


def result(job: Job, out: TextOut, done: bool = True, index: int | None = None) -> dict:
    r = {"text": out.shown, "output_ids": list(out.ids), "meta_info": meta_info(job, out, done)}
    if index is not None:
        r["index"] = index
    return r


def add_routes(app, jobs: Jobs, read_body) -> None:
    max_batch = app.state.config.max_batch_prompts

    @app.post("/generate", openapi_extra=request_body(GenerateRequest))
    async def generate(request: HTTPRequest):
        body = await read_body(request)
        batch, batched, stream = await off_loop(parse_generate, body, jobs.eos(), max_batch)
        for j in batch:
            j.rid = j.rid or new_id()
            if j.session is not None:
                await _continue_session(jobs, j)
        streams = await jobs.start(batch, {"stop_ids": "stop_token_ids", "prompt_logprobs_from": "logprob_start_len"})
        if stream:
            return StreamingResponse(_sse(jobs, batch, streams, batched, request), media_type="text/event-stream")
        outs = await jobs.finish(batch, streams, request)
        check_outcome(batch)
        # the answer (logprobs' texts, a long output) is built and serialized off the loop
        return await json_off_loop(lambda: [result(j, o) for j, o in zip(batch, outs)] if batched
                                   else result(batch[0], outs[0]))


async def _continue_session(jobs: Jobs, job: Job) -> None:
    """The prompt of a session continuation: the turn it continues (prompt and output, as
    the session recorded them) and then its own new tokens (text encoded without the
    special tokens a first turn gets: they are inside the context already)."""
    sid, rid, offset, drop = job.session
    runner = jobs.runner
    req = job.req
    try:  # the session of the request's own tenant (its salt), or none
        ctx = await runner.run(lambda: runner.sessions.context(sid, req.salt, rid, offset, drop))
    except UnknownSession as e:
        raise BadRequest(str(e), 404) from None
    except ValueError as e:
        raise BadRequest(str(e)) from None
    new = req.input_ids if req.input_ids is not None else \
        await off_loop(jobs.tokenizer.encode, req.text, add_special_tokens=False)
    req.input_ids, req.text = ctx + list(new), None


async def _sse(jobs: Jobs, batch: list[Job], streams, batched: bool, request):
    """Chunks in arrival order across the batch; each names its prompt by `index`."""
    outs = [jobs.text_out(j) for j in batch]
    getters = {asyncio.ensure_future(s.get()): i for i, s in enumerate(streams)}
    try:
        with jobs.streaming(request, lambda: [streams[i].req for i in getters.values()]):
            while getters:
                done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    i = getters.pop(t)
                    ids, finished = t.result()
                    before = (len(outs[i].ids), outs[i].shown)
                    outs[i].update(ids, finished)
                    if not finished:
                        getters[asyncio.ensure_future(streams[i].get())] = i
                    if finished or (len(outs[i].ids), outs[i].shown) != before:
                        # SGLang's chunks are cumulative (and the first may carry a long
                        # prompt's logprobs): built off the loop
                        chunk = await off_loop(_sse_chunk, batch[i], outs[i], finished, i if batched else None)
                        yield chunk
            yield "data: [DONE]\n\n"
    finally:  # what is left (the client went away) was aborted by jobs.streaming
        for t in getters:
            t.cancel()


def _sse_chunk(job: Job, out: TextOut, finished: bool, index: int | None) -> str:
    return f"data: {json.dumps(result(job, out, finished, index))}\n\n"
