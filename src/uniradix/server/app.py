"""The FastAPI application: authentication, body limits, JSON errors, and the admin
routes (health, sessions, cache flush, server and model info, metrics); the generation
routes are routes_native.py's and routes_openai.py's.

Every error is a JSON body `{"error": {"message", "type", "code"}}` with a 4xx (5xx only
for a fault of the server's own), so a bad request never kills the server."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..cache.audit import AuditError
from ..config import finite_number
from ..engine import Request, SamplingParams
from ..redact import redact, redact_value
from . import dashboard, routes_native, routes_openai, routes_tools
from .connections import CLOSED_BY_SERVER
from .jobs import Jobs
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import BadRequest, Job, parse_json, want
from .runner import EngineRunner
from .settings import ServerConfig

log = logging.getLogger("uniradix.server")

#: routes open without the API key: liveness, and the dashboard's page, which carries no
#: data (its script asks for the key to read /dashboard/data)
OPEN_ROUTES = ("/health", "/dashboard")


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
            408: "RequestTimeout", 413: "RequestTooLarge", 503: "ServiceUnavailable"}.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


def build_app(runner: EngineRunner, config: ServerConfig, metrics: ServerMetrics, model_name: str,
              engine_settings: dict) -> FastAPI:
    app = FastAPI(title="uniradix", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config
    app.state.model_name = model_name
    app.state.served_names = tuple(config.served_model_name or (model_name,))
    app.state.port = config.port  # serve() sets the bound one
    app.state.started = int(time.time())
    jobs = Jobs(runner, config.max_waiting_requests)
    engine = runner.engine

    app.add_middleware(Guard, config=config)

    @app.exception_handler(BadRequest)
    async def bad_request(request, exc: BadRequest):
        headers = {503: {"Retry-After": "1"}, 408: {"Connection": "close"}}.get(exc.status)
        return error(exc.status, exc.message, headers)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request, exc: ClientDisconnect):
        """The client's doing, not a fault: counted, one line, no traceback; the answer
        goes nowhere (499 is nginx's "client closed request"). A connection the server
        closed itself (connections.py: to make room, on shutdown) was counted there."""
        if request.scope.get("state", {}).get(CLOSED_BY_SERVER):
            return Response(status_code=499)
        metrics.client_disconnects.inc()
        peer = request.client
        log.info("client %s left during its request to %s: %s", f"{peer.host}:{peer.port}" if peer else "?",
                 request.url.path, str(exc) or "the connection closed")
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return error(400, str(exc.errors()[:3]))

    @app.exception_handler(Exception)
    async def fault(request, exc):
        log.exception("request to %s failed", request.url.path)
        return error(500, redact(f"internal error: {type(exc).__name__}: {exc}"))

    async def read_body(request: HTTPRequest, empty_ok: bool = False):
        """The body as JSON, parsed off the event loop (a large one takes a while). It
        must arrive within --request-body-timeout (408, and the connection closes); a
        client that leaves before it has is ClientDisconnect (client_left)."""
        parts, size = [], 0
        try:
            async with asyncio.timeout(config.request_body_timeout):
                async for part in request.stream():
                    parts.append(part)
                    size += len(part)
                    if size > config.max_request_bytes:
                        raise BadRequest(f"the request body is over {config.max_request_bytes} bytes "
                                         f"(--max-request-bytes)", 413)
        except TimeoutError:
            metrics.connections_closed.labels("body_timeout").inc()
            raise BadRequest(f"the request body did not arrive within {config.request_body_timeout:g} seconds "
                             f"({size} bytes came; --request-body-timeout)", 408) from None
        except ClientDisconnect:
            raise ClientDisconnect(f"it left after {size} of {request.headers.get('content-length', '?')} "
                                   f"body bytes") from None
        raw = b"".join(parts)
        if empty_ok and not raw.strip():
            return {}
        return await asyncio.to_thread(parse_json, raw)

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

    @app.post("/open_session")
    async def open_session(request: HTTPRequest):
        body = await read_body(request, empty_ok=True)
        want(isinstance(body, dict), "the request body", "a JSON object", body)
        timeout = body.get("timeout")
        want(timeout is None or (finite_number(timeout) and timeout > 0), "timeout", "a finite number > 0", timeout)
        sid = body.get("session_id")
        want(sid is None or (isinstance(sid, str) and sid) or (isinstance(sid, int) and not isinstance(sid, bool)),
             "session_id", "a non-empty string or an int", sid)
        return await runner.run(lambda: runner.sessions.open(sid, timeout))

    @app.post("/close_session")
    async def close_session(request: HTTPRequest):
        body = await read_body(request)
        want(isinstance(body, dict), "the request body", "a JSON object", body)
        sid = body.get("session_id")
        want((isinstance(sid, str) and sid) or (isinstance(sid, int) and not isinstance(sid, bool)), "session_id",
             "a non-empty string or an int", sid)
        return {"success": True, "closed": await runner.run(lambda: runner.close_session(sid))}

    def check_model(body: dict) -> None:
        """An OpenAI-style `model` must be one of the served names (404 otherwise, as
        vLLM answers); absent, the first is meant."""
        name = body.get("model")
        want(name is None or isinstance(name, str), "model", "a string", name)
        if name is not None and name not in app.state.served_names:
            raise BadRequest(f"the model {name!r:.80} does not exist; this server serves "
                             f"{', '.join(map(repr, app.state.served_names))}", 404)

    app.state.check_model = check_model

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    @app.post("/reset_prefix_cache")  # vLLM's name for it
    async def flush_cache(force: bool = False):
        """Empty the device and host tiers. Whatever the write policy, what the store
        lacks of them is written down first (write_back's host-only data included), and
        it is in the store when this answers, within the storage tier's io_timeout (the
        store itself is shared: never flushed from here). A write-down the store did not
        take keeps the tiers (503: nothing is lost) unless `?force=true`."""
        def flush():
            if engine.running or engine.waiting or engine.prefetching:
                return "busy"
            storage = engine.storage
            if storage is not None and not force:
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

    @app.get("/get_server_info")
    async def server_info():
        # every name here is a declared setting (its secrets hidden by as_dict): only texts are masked
        shown = {"version": _version(), **engine_settings, **config.as_dict(), "port": app.state.port,
                 "model_name": model_name}
        return {k: redact_value("", v) for k, v in shown.items()}

    @app.get("/get_model_info")
    async def model_info():
        m = engine.model
        layers = {spec.name: len(ls) for spec, ls in m.states().groups}
        return {"model_path": model_name, "model_type": m.name, "is_generation": True,
                "vocab_size": m.vocab_size, "context_length": engine.context_length,
                "eos_token_ids": list(jobs.eos()), "layers": layers,
                "has_chat_template": bool(getattr(m.tokenizer, "chat_template", None))}

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

    @app.get("/metrics")
    async def metrics_route():
        # one moment of the scheduler thread: counters and gauges agree
        return Response(metrics.render(await runner.run(runner.snapshot)), media_type=CONTENT_TYPE)

    @app.get("/dashboard")
    async def dashboard_page():
        return HTMLResponse(dashboard.page(), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/data")
    async def dashboard_data():
        info = {"model": model_name, "version": _version(), "started": app.state.started}
        return await runner.run(lambda: dashboard.dashboard_data(metrics.values(runner.snapshot()), runner.history,
                                                                 engine, info))

    routes_native.add_routes(app, jobs, read_body)
    routes_openai.add_routes(app, jobs, read_body)
    routes_tools.add_routes(app, jobs, read_body, check_model, _version())
    return app


class Guard:
    """The API key and the declared body size, checked before a route runs (plain ASGI,
    so that handlers still see the client's disconnect)."""

    def __init__(self, app, config: ServerConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refused = self.refuse(scope)
            if refused is not None:
                return await refused(scope, receive, send)
        return await self.app(scope, receive, send)

    def refuse(self, scope) -> JSONResponse | None:
        cfg = self.config
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if cfg.api_key and scope["path"] not in OPEN_ROUTES:
            given = headers.get("authorization", "")
            key = given[7:] if given.lower().startswith("bearer ") else headers.get("x-api-key", "")
            # the header's raw bytes (decoded as latin-1 above) against the key's UTF-8
            if not hmac.compare_digest(key.encode("latin-1"), cfg.api_key.encode("utf-8")):
                return error(401, "a valid API key is required: 'Authorization: Bearer KEY'")
        size = headers.get("content-length", "")
        if size.isdigit() and int(size) > cfg.max_request_bytes:
            return error(413, f"the request body is {size} bytes; the limit is {cfg.max_request_bytes} "
                              f"(--max-request-bytes)")
        return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("uniradix")
    except PackageNotFoundError:
        return "unknown"
