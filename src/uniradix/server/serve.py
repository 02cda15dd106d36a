"""`uniradix serve`: the engine from the same flags as `uniradix run`, its scheduler
thread, and the HTTP server on a socket bound here (so `--port 0` can report the port it
got). SIGTERM or SIGINT: stop accepting, let running requests finish for up to
--graceful-timeout seconds, abort the rest, wait for queued L3 writes, exit 0. SIGHUP
reopens --request-log (request_log.py). The connections' own limits (head timeout,
--max-connections) are connections.py's; every log line and start-up error goes through
uniradix.redact."""
from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import time
from dataclasses import replace


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from ..config import add_flags
    from .settings import ServerConfig
    add_flags(p, ServerConfig, "HTTP server")
    # the queue's bound under its old name (SGLang's is --max-queued-requests): old command lines still work
    p.add_argument("--max-waiting-requests", dest="max_queued_requests", type=int, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)


def cmd_serve(a: argparse.Namespace) -> int:
    from ..engine.flags import engine_from_args, pools_line, threads_from_args
    from ..config import from_args
    from ..redact import redact
    from .connections import connection_budget
    from .settings import ServerConfig
    _configure_logging()  # before the engine: its start-up warnings are masked too
    try:
        config = from_args(ServerConfig, a)
        if config.request_log:  # a path it cannot append to (or not a regular file) is a start-up error
            from .request_log import check_path
            check_path(config.request_log)
        budget = connection_budget(config.max_connections)
        threads = threads_from_args(a)  # before the model loads: it computes too
        logging.getLogger("uniradix.server").info("%s", threads)
        engine = engine_from_args(a, logging.getLogger("uniradix.server").info)
        logging.getLogger("uniradix.server").info("%s", pools_line(engine))
    except (ValueError, OSError, ImportError, RuntimeError) as e:
        print(f"uniradix serve: {redact(e)}", file=sys.stderr)
        return 2
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((config.host, config.port))
        sock.listen(budget.backlog)  # connections queue from here on, before uvicorn starts serving
    except OSError as e:
        print(f"uniradix serve: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
        engine.close()
        return 2
    settings = {**engine.config.as_dict(), "model_path": a.model_path,
                "model_preset": None if a.model_path else a.model_preset,
                "dtype": a.dtype, "quantization": a.quantization, "context_length": engine.context_length,
                "vocab_size": engine.model.vocab_size,  # what a request log's token ids are checked against
                "num_threads": _torch_threads()}
    name = config.served_model_name[0] if config.served_model_name else a.model_path or a.model_preset
    return serve(engine, config, sock, name, settings, budget)


def serve(engine, config, sock: socket.socket, model_name: str, engine_settings: dict, budget=None) -> int:
    import uvicorn

    from .app import build_app
    from .connections import ClientFaultsAtInfo, Limits, connection_budget, limited_protocol
    from .metrics import ServerMetrics
    from .runner import EngineRunner
    _configure_logging()
    budget = budget or connection_budget(config.max_connections)
    config = replace(config, max_connections=budget.max_connections)  # reported as in force
    metrics = ServerMetrics()
    request_log = None
    if config.request_log:
        from .request_log import RequestLog
        request_log = RequestLog(config.request_log, config.log_token_ids,
                                 on_drop=metrics.request_log_lines_dropped.inc)
        request_log.event("start", settings=engine_settings)
    runner = EngineRunner(engine, metrics, config.session_timeout, config.log_requests, config.log_interval,
                          request_log, config.waiting_timeout)
    app = build_app(runner, config, metrics, model_name, engine_settings)
    runner.start()
    # on a signal the runner gets the graceful deadline: it aborts what is still running
    # then, so every handler answers (503, or an aborted stream's last chunk) before
    # uvicorn's own, later deadline would cut connections
    limits = Limits(config.request_header_timeout, budget.max_connections, metrics, config.response_write_timeout,
                    config.graceful_timeout)
    server = _server_class()(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           http=limited_protocol(limits), backlog=budget.backlog,
                                           timeout_keep_alive=config.timeout_keep_alive,
                                           timeout_graceful_shutdown=config.graceful_timeout + 10),
                             lambda: runner.request_stop(config.graceful_timeout))
    _configure_logging()  # uvicorn's handlers exist now: they mask secrets too
    logging.getLogger("uvicorn.error").addFilter(ClientFaultsAtInfo())
    host, port = sock.getsockname()[:2]
    app.state.port = port  # --port 0: the one bound, for /get_server_info
    if engine.storage is not None:  # the others sharing its L3 see it, and it sees them
        engine.storage.announce(model=model_name, url=_address(host, port))
    shown = {**engine_settings, **config.as_dict(), "port": port}
    logging.getLogger("uniradix.server").info("settings: %s", json.dumps(shown, default=str))
    for sig in (signal.SIGINT, signal.SIGTERM):  # a signal before uvicorn takes over stops it too
        signal.signal(sig, server.handle_exit)
    if request_log is not None:  # logrotate's postrotate: the log is opened again at its path
        signal.signal(signal.SIGHUP, lambda sig, frame: request_log.reopen())
    _say(f"uniradix serve: {model_name} on http://{host}:{port}")
    try:
        server.run(sockets=[sock])
    finally:
        runner.stop(timeout=0.0)  # uvicorn waited for the running requests already
        if engine.storage is not None:  # closed by the engine's close already, unless that failed
            _close_backend(engine, runner.stop_deadline)
        sock.close()
        if request_log is not None:  # within what is left of the graceful timeout (a second at least)
            deadline = runner.stop_deadline
            request_log.close(max(1.0, config.graceful_timeout if deadline is None
                                  else deadline - time.monotonic()))
    _say("uniradix serve: stopped")
    return 0 if runner.failure is None else 1


def _address(host: str, port: int) -> str:
    """The server's address as another machine would use it: the host name for an
    unspecified bind address, an IPv6 address in brackets."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def _close_backend(engine, deadline: float | None) -> None:
    """Close the L3 backend within what is left of the graceful timeout (without a stop
    asked for, the tier's io_timeout): a store that hangs leaves its close behind
    (logged), and the process ends without waiting for it (uniradix.cli.main)."""
    left = engine.storage.io_timeout if deadline is None else max(0.0, deadline - time.monotonic())
    engine.close_backend(left)


def _say(line: str) -> None:
    """A line on stdout in one write: stderr reaches the same terminal or pipe through
    the masking relay (uniradix.stderr_relay) at its own pace, and print's two writes
    (unbuffered, PYTHONUNBUFFERED) could let a log line in between, gluing it to the
    address a supervisor reads."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _configure_logging() -> None:
    """Info lines with their time and logger; every handler masks secrets."""
    from ..redact import redact_logs
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    redact_logs()


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """A signal asks the server to stop, not the process to die: `on_exit` starts the
        runner's graceful stop, and after the shutdown `serve` returns and the process
        exits 0 (uvicorn would re-raise the signal)."""

        def __init__(self, config, on_exit) -> None:
            super().__init__(config)
            self.on_exit = on_exit

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()
            self.on_exit()
    return Server
