"""The server's own settings (the engine's are uniradix.config's), declared once: the
`uniradix serve` flags are generated from them."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import Settings, count, declare_plain_settings, number, optional, setting, text


def _port(v):
    return None if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 65535 else "an int in [0, 65535]"


def _names(v):
    ok = isinstance(v, (tuple, list)) and v and all(isinstance(x, str) and x for x in v)
    return None if ok else "one or more non-empty names"


@dataclass(frozen=True)
class ServerConfig(Settings):
    """HTTP server"""

    host: str = setting("127.0.0.1", "address to listen on", check=text)
    port: int = setting(30000, "port to listen on (0: any free one; the address is printed at start-up)",
                        check=_port)
    api_key: str | None = setting(None, "clients must send 'Authorization: Bearer KEY' (every route but /health and "
                                  "the /dashboard page, which asks for the key to read its data)",
                                  check=optional(text), secret=True)
    served_model_name: tuple | None = setting(
        None, "the model's name(s) in the OpenAI API: requests may name any, answers give the first, another "
              "name is a 404 (default: the model path, or the preset)", check=optional(_names), several=True)
    max_queued_requests: int = setting(
        256, "requests queued beyond the running batch's free places (SGLang's name; --max-waiting-requests "
             "is the old one); a request past it is refused at once with 503 and Retry-After, and keeps its "
             "place in line for its retries: the places that free go to the refused requests in the order they "
             "were first refused", check=count())
    waiting_timeout: float | None = setting(
        None, "seconds a queued request may wait to start (SGLang's SGLANG_REQ_WAITING_TIMEOUT); past it, it "
              "ends with 503 and Retry-After (a stream: an abort chunk). Default: it waits until it runs",
        check=optional(number(above=0)))
    max_request_bytes: int = setting(8 << 20, "largest request body in bytes (413 beyond)", check=count())
    max_batch_prompts: int = setting(64, "prompts in one batched /generate or completions request", check=count())
    session_timeout: float | None = setting(None, "seconds a session may stay unused before it is closed "
                                            "(default: until /close_session; /open_session may set its own)",
                                            check=optional(number(above=0)))
    log_requests: bool = setting(False, "log one line per finished request: its id, how it ended, prompt, "
                                 "cached (by tier), computed and output tokens, TTFT, latency")
    request_log: str | None = setting(None, "append one JSON line per finished request to this file (time, "
                                      "rid, session, prompt and cached tokens by tier, TTFT, latency; no text): "
                                      "read it with `uniradix hit-rate`. A regular file only; reopened on SIGHUP and "
                                      "when PATH is moved or removed (log rotation)", check=optional(text),
                                      metavar="PATH")
    log_token_ids: bool = setting(False, "--request-log also records each request's prompt and output token "
                                  "ids (and a digest of its cache salt), so `uniradix simulate` can replay it")
    log_interval: float | None = setting(10.0, "while requests run, log a line this often (seconds): running and "
                                         "waiting requests, new and cached prompt tokens, decode throughput, "
                                         "each component's pool in use", check=optional(number(above=0)))
    graceful_timeout: float = setting(30.0, "seconds a SIGTERM'd server takes at most: running requests finish "
                                      "(then are aborted), then the tiers are written down to L3 (with L3 the "
                                      "last quarter is kept for that, at most io_timeout)",
                                      check=number(at_least=0))
    timeout_keep_alive: float = setting(5.0, "seconds an idle keep-alive connection stays open",
                                        check=number(above=0))
    request_header_timeout: float = setting(
        10.0, "seconds a client has to send a whole request head (request line and headers), from when its "
              "connection opens or its previous response ends; a slower one is closed (408 if it had begun)",
        check=number(above=0))
    request_body_timeout: float = setting(
        60.0, "seconds a client has to send a whole request body once its head is in (408 beyond)",
        check=number(above=0))
    response_write_timeout: float = setting(
        60.0, "seconds a response may wait for a client that reads none of it (its socket full); the "
              "connection is then cut and its request aborted", check=number(above=0))
    max_connections: int | None = setting(
        None, "HTTP connections open at once (default: 1024, or what the file descriptor limit leaves room "
              "for); at the limit the connection waiting longest for a request head is closed to make "
              "room, else the one sending its request body longest (answered 503), else the one whose "
              "client has read nothing longest, or, with every one holding a whole request and a client that "
              "reads, the new one is answered 503 and closed", check=optional(count()))

    def check(self) -> None:
        if self.log_token_ids and not self.request_log:
            raise ValueError("--log-token-ids adds token ids to the --request-log lines: give --request-log PATH too")


declare_plain_settings(ServerConfig)  # its names shown wherever text is masked (api_key: secret)
