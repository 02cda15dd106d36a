"""The admin routes: liveness (`/health`, `/health_generate`), sessions
(`/open_session`, `/close_session`), the cache flush (`/flush_cache`, and vLLM's
`/reset_prefix_cache`), what is served (`/get_server_info`, `/get_model_info`, and
SGLang's newer `/server_info`, `/model_info`) and the
handle audit (`/audit`)."""
from __future__ import annotations

import logging

from fastapi import Request as HTTPRequest
from fastapi.responses import PlainTextResponse, Response

from ..cache.audit import AuditError
from ..config import finite_number
from ..engine import Request, SamplingParams
from ..engine.speculation import tokens_a_verify
from ..redact import redact_value
from .errors import error
from .protocol import BadRequest, Job, session_route, want
from .query import query_bool

log = logging.getLogger("uniradix.server")


def add_routes(app, jobs, read_body, engine_settings: dict, version: str) -> None:
    """The operator's routes, by what they are about: health, sessions, the cache, the
    server and its model."""
    add_health_routes(app, jobs)
    add_session_routes(app, jobs.runner, read_body)
    add_cache_routes(app, jobs.runner, jobs.engine)
    add_info_routes(app, jobs, engine_settings, version)


def add_health_routes(app, jobs) -> None:
    runner, engine = jobs.runner, jobs.engine

    @app.get("/health")
    async def health():
        if runner.failure is not None or not runner.thread.is_alive():
            return error(503, "the scheduler thread is not running")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        req = Request(input_ids=[1 % engine.model.vocab_size], sampling=SamplingParams(max_new_tokens=1))
        job = Job(req)
        try:
            streams = await jobs.start([job])
        except BadRequest as e:
            return error(503, f"cannot generate: {e.message}")
        await jobs.finish([job], streams)
        if req.status != "finished":
            return error(503, f"generation failed: {req.error}")
        return Response(status_code=200)


def add_session_routes(app, runner, read_body) -> None:
    @app.post("/open_session")
    async def open_session(request: HTTPRequest):
        """Open a session of the tenant the body's `cache_salt` / `extra_key` name (as on
        /generate). An id open under another tenant is this tenant's own new session:
        nothing of the other is seen or touched, so an id neither leaks nor is taken."""
        body = await read_body(request, empty_ok=True)
        sid, salt = session_route(body, need_id=False)
        timeout = body.get("timeout")
        want(timeout is None or (finite_number(timeout) and timeout > 0), "timeout", "a finite number > 0", timeout)
        return await runner.run(lambda: runner.sessions.open(sid, timeout, salt))

    @app.post("/close_session")
    async def close_session(request: HTTPRequest):
        """Close the tenant's session of that id: another tenant's is `closed: false`,
        the same answer as an id never opened."""
        sid, salt = session_route(await read_body(request), need_id=True)
        return {"success": True, "closed": await runner.run(lambda: runner.close_session(sid, salt))}


def add_cache_routes(app, runner, engine) -> None:
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    @app.post("/reset_prefix_cache")  # vLLM's name for it
    async def flush_cache(force: str | None = None):
        """Empty the device and host tiers. Whatever the write policy, what the store
        lacks of them is written down first (write_back's host-only data included), and
        it is in the store when this answers, within the storage tier's io_timeout (the
        store itself is shared: never flushed from here). A write-down the store did not
        take keeps the tiers (503: nothing is lost) unless `?force=true`."""
        force_ = query_bool("force", force, False)

        def flush():
            if engine.running or engine.waiting or engine.prefetching:
                return "busy"
            storage = engine.storage
            if storage is not None and not force_:
                if not storage.write_down():
                    return "unwritten"
                return "ok" if engine.cache.flush(write_down=False) else "busy"
            ok = engine.cache.flush()
            engine.flush_writes()
            return "ok" if ok else "busy"
        outcome = await runner.run(flush)
        if outcome == "ok":
            return PlainTextResponse("Cache flushed.\n")
        if outcome == "unwritten":
            log.warning("/flush_cache refused: the write-down to L3 failed or was cut short")
            return error(503, "the cache was not flushed: writing it down to L3 failed or took longer than "
                              "io_timeout (see uniradix_storage_errors_total), and flushing would lose what only "
                              "the device and host tiers hold; retry, or POST /flush_cache?force=true to drop it",
                         {"Retry-After": "1"})
        return error(400, "cannot flush the cache while requests are running; retry when idle")

    @app.get("/audit")
    async def audit():
        """Every cache handle owned exactly once (uniradix.cache.audit); `settled`: and no
        lock left, checked only when nothing is running."""
        def check():
            idle = not (engine.running or engine.waiting or engine.prefetching)
            engine.audit(settled=idle)
            return {"ok": True, "settled": idle}
        try:
            return await runner.run(check)
        except AuditError as e:
            return error(500, f"audit failed: {e}")


def add_info_routes(app, jobs, engine_settings: dict, version: str) -> None:
    engine, config, model_name = jobs.engine, app.state.config, app.state.model_name

    @app.get("/get_server_info")
    @app.get("/server_info")   # SGLang's newer name, the one its gateway asks first
    async def server_info():
        # every name here is a declared setting (its secrets hidden by as_dict): only texts are masked
        storage = engine.storage
        shown = {"version": version, **engine_settings, **config.as_dict(), "port": app.state.port,
                 "model_name": model_name,
                 # this server in its L3 namespace, and the other instances announcing themselves there
                 "l3_instances": None if storage is None else storage.fleet()}
        if engine.spec is not None:   # SGLang's place for it, where its bench_serving reads it
            c = engine.counters
            shown["internal_states"] = [{"avg_spec_accept_length":
                                         tokens_a_verify(c["spec_accepted_tokens"], c["spec_verify_steps"])}]
        return {k: redact_value("", v) for k, v in shown.items()}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        m = engine.model
        layers = {spec.name: len(ls) for spec, ls in m.states().groups}
        return {"model_path": model_name, "model_type": m.name, "is_generation": True,
                "vocab_size": m.vocab_size, "context_length": engine.context_length,
                "eos_token_ids": list(jobs.eos()), "layers": layers,
                "has_chat_template": bool(getattr(m.tokenizer, "chat_template", None))}
