"""The FastAPI application: authentication, body limits, JSON errors, the body reader
and the served-model check every route group shares. The routes are the groups':
routes_admin.py (health, sessions, cache flush, server and model info, audit),
routes_observe.py (metrics, dashboard, the tree's shape), routes_native.py (SGLang's
/generate), routes_openai.py (OpenAI's API), routes_tools.py (tokenize, version). The
OpenAPI schema (/openapi.json, and FastAPI's page of it, /docs) declares the generation
routes' bodies by their models (bodies.py).

Every error is a JSON body `{"error": {"message", "type", "code"}}` with a 4xx (5xx only
for a fault of the server's own), so a bad request never kills the server."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import warnings

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import installed_version
from ..redact import redact
from . import routes_admin, routes_native, routes_observe, routes_openai, routes_tools
from .bodies import openapi_schemas
from .connections import CLOSED_BY_SERVER
from .errors import ERROR_SCHEMA, error
from .jobs import Jobs
from .metrics import ServerMetrics
from .offload import off_loop
from .protocol import BadRequest, parse_json, want
from .runner import EngineRunner
from .settings import ServerConfig

log = logging.getLogger("uniradix.server")

#: routes open without the API key: liveness, and the pages that carry no data: the
#: dashboard's (its script asks for the key to read /dashboard/data), the OpenAPI schema
#: and FastAPI's page of it (whose requests send the key once it is given: `bearer`)
OPEN_ROUTES = ("/health", "/dashboard", "/docs", "/openapi.json")


def build_app(runner: EngineRunner, config: ServerConfig, metrics: ServerMetrics, model_name: str,
              engine_settings: dict) -> FastAPI:
    version = installed_version()
    app = FastAPI(title="uniradix", version=version, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.config = config
    app.state.model_name = model_name
    app.state.served_names = tuple(config.served_model_name or (model_name,))
    app.state.port = config.port  # serve() sets the bound one
    app.state.started = int(time.time())
    jobs = Jobs(runner, config.max_queued_requests)

    app.add_middleware(Guard, config=config)

    add_error_handlers(app, metrics)
    read_body = body_reader(config, metrics)

    def check_model(body: dict) -> None:
        """An OpenAI-style `model` must be one of the served names (404 otherwise, as
        vLLM answers); absent, the first is meant."""
        name = body.get("model")
        want(name is None or isinstance(name, str), "model", "a string", name)
        if name is not None and name not in app.state.served_names:
            raise BadRequest(f"the model {name!r:.80} does not exist; this server serves "
                             f"{', '.join(map(repr, app.state.served_names))}", 404)

    app.state.check_model = check_model

    routes_admin.add_routes(app, jobs, read_body, engine_settings, version)
    routes_observe.add_routes(app, jobs, metrics, version)
    routes_native.add_routes(app, jobs, read_body)
    routes_openai.add_routes(app, jobs, read_body)
    routes_tools.add_routes(app, jobs, read_body, check_model, version)
    app.openapi = lambda: openapi(app)
    return app


def openapi(app: FastAPI) -> dict:
    """FastAPI's schema of the routes, built once, with what it cannot see: the bodies
    the generation routes read and validate themselves (bodies.py: their `openapi_extra`
    names them), and the errors as they are answered (400 with `Error`, not FastAPI's 422)."""
    if app.openapi_schema is None:
        with warnings.catch_warnings():  # its duplicate operation ids are made unique below
            warnings.filterwarnings("ignore", "Duplicate Operation ID", UserWarning)
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        schemas.update(openapi_schemas(), Error=ERROR_SCHEMA)
        seen = set()
        for method, operation in ((m, op) for path in schema.get("paths", {}).values() for m, op in path.items()):
            if operation.get("operationId") in seen:  # one route of several methods: FastAPI names each alike
                operation["operationId"] = f"{operation['operationId']}_{method}"
            seen.add(operation.get("operationId"))
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            responses["400"] = {"description": "A bad request: the message names the field",
                                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        if app.state.config.api_key:
            schema["components"].setdefault("securitySchemes", {})["bearer"] = {
                "type": "http", "scheme": "bearer", "description": "--api-key"}
            schema["security"] = [{"bearer": []}]
        app.openapi_schema = schema
    return app.openapi_schema


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error a JSON body with its status; a client that left is its own doing."""

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


def body_reader(config: ServerConfig, metrics: ServerMetrics):
    """The routes' reader of a request body (`read_body(request, empty_ok=False)`)."""

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
        return await off_loop(parse_json, raw)
    return read_body


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
        if size.isascii() and size.isdigit() and int(size) > cfg.max_request_bytes:
            return error(413, f"the request body is {size} bytes; the limit is {cfg.max_request_bytes} "
                              f"(--max-request-bytes)")
        return None
