"""The HTTP side of a request's life, shared by both APIs: prepare on the handler's
thread (checks and tokenizing, so bad input is a 4xx before anything is queued), admit
against the queue's bound (a refused request keeps its place in line), hand to the scheduler, then wait for the end (or stream), and
abort whatever is left when the client goes away: its doing, counted
(uniradix_client_disconnects) and logged in one info line, as a client that leaves
mid-body is (app.py), unless the server closed the connection itself (connections.py
counted that)."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import uuid
from array import array

from .connections import CLOSED_BY_SERVER
from .offload import off_loop
from .protocol import BadRequest, Job
from .runner import EngineRunner, Stream
from .textout import TextOut

log = logging.getLogger("uniradix.server")


class Jobs:
    """What the routes share: the engine's runner, the queue's bound, the tokenizer."""

    def __init__(self, runner: EngineRunner, max_queued: int) -> None:
        self.runner = runner
        self.engine = runner.engine
        self.tokenizer = runner.engine.tokenizer
        self.max_queued = max_queued

    def eos(self) -> tuple[int, ...]:
        return tuple(getattr(self.engine.model, "eos_token_ids", ()) or ())

    async def start(self, jobs: list[Job], names: dict | None = None) -> list[Stream]:
        """Check every job (off the event loop: tokenizing a long prompt takes a while),
        then queue all of them, or none: a 4xx / 503 raised. `names`: the API's names
        for the engine's fields, so that a message names what the client sent. A full
        queue refuses at once; the refused request keeps its place in line for its
        retries (waitlist.py)."""
        key = await off_loop(self._prepare, jobs, names or {})
        most = self.max_queued + self.engine.max_running
        if len(jobs) > most:  # it would be refused however idle the server is
            raise BadRequest(f"a batch of {len(jobs)} prompts is more than this server queues at once ({most}: "
                             f"--max-queued-requests + --max-running-requests)")
        if not self.runner.admit(len(jobs), self.max_queued, key):
            if self.runner.metrics is not None:
                self.runner.metrics.requests_refused.labels("queue_full").inc()
            raise BadRequest(f"the queue is full ({self.max_queued} requests waiting beyond the running batch: "
                             f"--max-queued-requests); retry after 1 s: the same request sent again keeps its "
                             f"place in line", 503)
        loop = asyncio.get_running_loop()
        streams = [Stream(job.req, loop, job.rid, job.session is not None) for job in jobs]
        for s in streams:
            self.runner.submit(s)
        return streams

    def _prepare(self, jobs: list[Job], names: dict) -> bytes:
        """Check and tokenize every job; what identifies the request (`retry_key`)."""
        for i, job in enumerate(jobs):
            try:
                why = self.engine.prepare(job.req)
            except ValueError as e:
                why = str(e)
            if why:
                why = why.replace(f"request {job.req.rid}", f"prompt {i}" if len(jobs) > 1 else "the prompt")
                for engine_name, api_name in names.items():
                    why = why.replace(engine_name, api_name)
                raise BadRequest(why)
        return retry_key(jobs)

    async def finish(self, jobs: list[Job], streams: list[Stream], request=None) -> list[TextOut]:
        """Wait until every stream ends; if the client of `request` (an HTTP request)
        leaves first, what is left is aborted (`left`). Returns each job's final text."""
        outs = [self.text_out(j) for j in jobs]
        pending = {asyncio.ensure_future(self._drain(s, o)): s for s, o in zip(streams, outs)}
        gone = False
        try:
            while pending:
                done, _ = await asyncio.wait(pending, timeout=0.5)
                for t in done:
                    pending.pop(t)
                if pending and request is not None and await request.is_disconnected():
                    gone = True
                    break
        finally:
            for t in pending:
                t.cancel()
            unfinished = [s.req for s in pending.values()]
            if gone:
                self.left(request, unfinished, "while it waited for its answer")
            else:
                self.abort(unfinished)
        return outs

    @contextlib.contextmanager
    def streaming(self, request, unfinished):
        """Around a streamed answer's generator: if it stops early, the requests
        `unfinished()` names are aborted; stopped from outside (cancelled or closed:
        the client went away) it is the client leaving (`left`)."""
        try:
            yield
        except Exception:
            self.abort(unfinished())
            raise
        except BaseException:
            self.left(request, unfinished(), "mid-stream")
            raise

    def abort(self, reqs) -> None:
        for req in reqs:
            self.runner.abort(req)

    def left(self, request, reqs, when: str) -> None:
        """The client of `request` went away `when`: its unfinished requests are aborted
        and, unless the server closed the connection itself, it is counted and logged."""
        self.abort(reqs)
        if not reqs or request.scope.get("state", {}).get(CLOSED_BY_SERVER):
            return
        if self.runner.metrics is not None:
            self.runner.metrics.client_disconnects.inc()
        peer = request.client
        log.info("client %s left during its request to %s: it left %s (%d request%s aborted)",
                 f"{peer.host}:{peer.port}" if peer else "?", request.url.path, when, len(reqs),
                 "" if len(reqs) == 1 else "s")

    async def _drain(self, s: Stream, out: TextOut) -> None:
        while True:
            ids, done = await s.get()
            out.update(ids, done)
            if done:
                return

    def text_out(self, job: Job) -> TextOut:
        return TextOut(self.tokenizer, job.stop, job.skip_special_tokens, job.no_stop_trim)


def check_outcome(jobs: list[Job]) -> None:
    """A request the engine failed (it could not fit after all, or a fault) or aborted
    (shutdown, or its --waiting-timeout): a 4xx/5xx for a non-streaming response."""
    for job in jobs:
        req = job.req
        if req.status == "error":
            raise BadRequest(req.error or "the request failed", 400 if "never fit" in (req.error or "") else 500)
        if req.status == "aborted":  # retry later, or on another replica
            raise BadRequest(f"the request was aborted: {req.error}", 503)


def retry_key(jobs: list[Job]) -> bytes:
    """What a request is known by in the line of refused requests (waitlist.py): what it
    asks, prompt by prompt (the prepared ids, tenant, session, sampling and what comes
    back), so that the same request sent again is its own retry; not the id the server
    gives it. Two clients sending the very same request share one place."""
    h = hashlib.blake2b(digest_size=16)
    for job in jobs:
        r = job.req
        h.update(array("Q", r.input_ids or ()).tobytes())
        h.update(repr((r.salt, r.session_id, r.sampling, r.priority, r.logprobs, r.prompt_logprobs_from,
                       r.record_logits, job.stop, job.skip_special_tokens, job.no_stop_trim, job.logprobs,
                       job.echo, job.session, job.text_in_logprobs)).encode())
    return h.digest()


def new_id(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex


def cached_split(req) -> dict:
    """Cached prompt tokens by the tier they came from (they sum to cached_tokens)."""
    m = req.metrics
    return {"device": m.cached_tokens - m.host_tokens - m.storage_tokens, "host": m.host_tokens,
            "storage": m.storage_tokens}


def finish_reason(req):
    """SGLang's finish_reason object."""
    if req.finish_reason == "stop":
        return {"type": "stop", "matched": req.matched_stop}
    if req.finish_reason == "length":
        return {"type": "length", "length": len(req.output_ids)}
    if req.finish_reason in ("abort", "error"):
        return {"type": "abort", "message": req.error}
    return None


def openai_finish(req) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "abort", "error": "abort"}.get(req.finish_reason)


def usage(reqs) -> dict:
    """OpenAI's usage; where speculation verified drafts, their fate as OpenAI counts a
    predicted output's tokens (completion_tokens_details: drafts kept, drafts rejected)."""
    p = sum(r.metrics.prompt_tokens for r in reqs)
    c = sum(len(r.output_ids) for r in reqs)
    out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
           "prompt_tokens_details": {"cached_tokens": sum(r.metrics.cached_tokens for r in reqs)}}
    if any(r.metrics.spec_verify_ct for r in reqs):
        kept = sum(r.metrics.spec_accepted_tokens for r in reqs)
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": kept,
            "rejected_prediction_tokens": sum(r.metrics.spec_draft_tokens for r in reqs) - kept}
    return out
