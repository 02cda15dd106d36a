"""Limits on the HTTP connections themselves, below the application: how long a client
may take to send a request head, and how many connections may be open at once.

uvicorn closes an idle keep-alive connection, but a connection that never completes a
request head (a byte a second, or nothing at all after connecting), one that sends its
body a byte at a time, and one that never reads its answer were held forever, and once
the process ran out of file descriptors new clients went unanswered. Here:

- a connection has `--request-header-timeout` seconds from when it opens, or from the
  end of its previous response, to send a whole request head; then it is closed (with
  a 408 if part of a head had come). The body has its own timeout, in the app's reader.
- a response that waits `--response-write-timeout` seconds for a client that reads
  none of it (every buffer on the way full) is cut, and its request aborted. Nothing
  waits in the process's own buffer unseen: a close with bytes still unsent is cut
  the same way, so a closed connection's descriptor is never held by its client.
- at `--max-connections` a new connection first makes room by closing the one that
  has waited longest for a request head (idle, or a head trickling in), else the one
  that has been sending its request body longest (answered 503: its request has not
  reached the engine), else the one whose client has read nothing of its answer the
  longest; when every connection has a whole request in and a client that reads, the
  new one is answered 503 and closed at once.
- on shutdown a request whose body is still arriving is answered 503 at once, and a
  connection still open `STUCK_AFTER_GRACEFUL` seconds past --graceful-timeout (by
  then every handler has answered: it is its client that does not read) is cut, so
  uvicorn never has to cancel a handler.
- the cap, and how many connections the event loop accepts at one wake-up, are sized
  against the file descriptor limit at start-up, so the process never runs out of
  descriptors however many clients connect.

A connection the server closes while its handler still reads the body is marked in the
request's ASGI state (`CLOSED_BY_SERVER`), so the app does not count it as a client
that left. What a client gets wrong below the app (bytes that are not HTTP, an Upgrade
this server does not speak) is its doing: counted (`bad_request`) and logged at info
level, not as uvicorn's warnings (`ClientFaultsAtInfo`)."""
from __future__ import annotations

import http
import json
import logging
import os
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

#: file descriptors kept for the rest of the process (model files, storage connections,
#: logs) beyond those open when the server starts
FD_RESERVE = 128
DEFAULT_MAX_CONNECTIONS = 1024
#: the listen queue, and the most connections the event loop accepts at one wake-up
MAX_BACKLOG = 2048
#: accepted sockets not yet closed beyond the cap: the event loop accepts a burst per
#: wake-up and a socket closed past the cap lets its descriptor go a few turns later
BURSTS_IN_FLIGHT = 4
#: seconds past the graceful timeout after which a connection still open is cut: the
#: runner has aborted what still ran by the graceful deadline and every handler has
#: answered, so what is left waits on its client (uvicorn's own, later deadline would
#: cancel the handlers, a traceback each)
STUCK_AFTER_GRACEFUL = 1.0
#: the key, in a request's ASGI state, that says the server closed its connection (why)
CLOSED_BY_SERVER = "uniradix_closed_by_server"


@dataclass(frozen=True)
class ConnectionBudget:
    """How many connections stay open (`max_connections`) and how many the event loop
    accepts at once (`backlog`, also the listen queue), sized so that both together fit
    the file descriptor limit: past it asyncio's accept fails in a storm of errors."""

    max_connections: int
    backlog: int


def connection_budget(asked: int | None) -> ConnectionBudget:
    """--max-connections against the file descriptor limit, whose soft value is raised
    toward the hard one when it is short (as SGLang does). The default is 1024 or what
    the limit leaves room for; more than that, asked for, is a ValueError naming the
    flag and the limit."""
    try:
        import resource
    except ImportError:  # no rlimits here: trust the flag
        return ConnectionBudget(asked or DEFAULT_MAX_CONNECTIONS, MAX_BACKLOG)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = _open_fds()
    need = (asked or DEFAULT_MAX_CONNECTIONS) + in_use + FD_RESERVE + BURSTS_IN_FLIGHT * MAX_BACKLOG
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    room = need - in_use - FD_RESERVE if soft == resource.RLIM_INFINITY else soft - in_use - FD_RESERVE
    backlog = max(1, min(MAX_BACKLOG, room // (2 * BURSTS_IN_FLIGHT)))  # at most half the room in flight
    room -= BURSTS_IN_FLIGHT * backlog
    why = (f"the file descriptor limit ({soft}) leaves room for {max(room, 0)} connections ({in_use} descriptors "
           f"are open, {FD_RESERVE} kept for the engine, {BURSTS_IN_FLIGHT * backlog} for sockets being accepted)")
    if asked is None:
        if room < 1:
            raise ValueError(f"{why}; raise ulimit -n")
        return ConnectionBudget(min(DEFAULT_MAX_CONNECTIONS, room), backlog)
    if asked > room:
        raise ValueError(f"--max-connections {asked} is more than {why}; lower it or raise ulimit -n")
    return ConnectionBudget(asked, backlog)


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


def raw_response(status: int, message: str, headers: dict | None = None) -> bytes:
    """A whole HTTP/1.1 response with the app's JSON error body, written below the app
    (the connection closes after it)."""
    phrase = http.HTTPStatus(status).phrase
    body = json.dumps({"error": {"message": message, "type": phrase.replace(" ", ""), "code": status}}).encode()
    lines = [f"HTTP/1.1 {status} {phrase}", "content-type: application/json", f"content-length: {len(body)}",
             "connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Limits:
    """What the connections of one server share: the settings, the metrics, and the
    connections that may make room at the cap: those waiting for a request head, those
    still sending a request body, those whose client reads nothing (each the longest
    first). `graceful_timeout`: the server's; a connection still open
    STUCK_AFTER_GRACEFUL seconds past it on shutdown is cut."""

    def __init__(self, header_timeout: float, max_connections: int, metrics, write_timeout: float = 60.0,
                 graceful_timeout: float = 30.0) -> None:
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.metrics = metrics
        self.write_timeout = write_timeout
        self.stuck_after = graceful_timeout + STUCK_AFTER_GRACEFUL
        self.waiting: dict = {}    # insertion order: the longest waiting first
        self.receiving: dict = {}  # a whole head in, its body still arriving
        self.stalled: dict = {}    # an answer going out that the client does not read

    def make_room(self, newcomer) -> bool:
        """Close the connection that has waited longest for a request head, else the
        one that has sent its request body longest, else the one whose client has read
        nothing longest; False if every open connection has a whole request in and a
        client that reads."""
        victim = next((c for c in self.waiting if c is not newcomer), None)
        if victim is not None:
            victim.cut("evicted")
            return True
        victim = next((c for c in self.receiving if c is not newcomer), None)
        if victim is not None:
            victim.cut("evicted", 503, f"the server has {self.max_connections} connections open (--max-connections) "
                                       f"and closed this one, whose request body was still arriving, to make room; "
                                       f"retry shortly", {"retry-after": "1"})
            return True
        victim = next((c for c in self.stalled if c is not newcomer), None)
        if victim is None:
            return False
        victim.cut("evicted")
        return True


class ClientFaultsAtInfo(logging.Filter):
    """uvicorn logs what a client gets wrong as warnings (a request that is not HTTP; an
    Upgrade header, with advice to install a WebSocket library this server has no use
    for): any client could fill the log with them. They are the client's doing: info."""

    MESSAGES = ("Invalid HTTP request received.", "Unsupported upgrade request.")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and isinstance(record.msg, str):
            if record.msg.startswith("No supported WebSocket library detected"):
                return False
            if record.msg in self.MESSAGES:
                record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def limited_protocol(limits: Limits) -> type:
    """uvicorn's h11 protocol with these limits (uvicorn.Config(http=...))."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})


class LimitedH11Protocol(H11Protocol):
    """A connection that must send each request head in time, read its answers, and
    that counts against --max-connections. `_awaited` is the request cycle that was
    current when waiting for the client began: a head has arrived once `cycle` is
    another."""

    limits: Limits

    def connection_made(self, transport) -> None:
        self._deadline = None
        self._awaited = None
        self._partial = False
        self._write_stall = None
        self._lost = False
        self._closed_for = None  # why the server closed it, once it has
        super().connection_made(transport)
        # the transport pauses the writer as soon as a byte waits in its own buffer (the
        # socket is full): a stalled client is then seen however little was left unsent,
        # after a close too, and a handler waits for its client rather than buffering
        transport.set_write_buffer_limits(high=0)
        lim = self.limits
        lim.metrics.connections_open.inc()
        if len(self.connections) > lim.max_connections and not lim.make_room(self):
            lim.metrics.connections_refused.inc()
            transport.write(raw_response(503, f"the server has {lim.max_connections} connections open "
                                              f"(--max-connections), each busy with a request; retry shortly",
                                         {"retry-after": "1"}))
            self.close_now()
            return
        self._await_request()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP (the connection closes after it)."""
        self._closed_for = "bad_request"
        self.limits.metrics.connections_closed.labels("bad_request").inc()
        super().send_400_response(msg)

    def on_response_complete(self) -> None:
        finished = self.cycle
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.cycle is finished:  # the next request is not in yet
            self._await_request()
        else:  # a pipelined one was: it is under way already
            self._awaited = finished
            self._track()

    def connection_lost(self, exc) -> None:
        self._lost = True
        self._cancel_deadline()
        self._cancel_write_stall()
        self.limits.waiting.pop(self, None)
        self.limits.receiving.pop(self, None)
        self.limits.metrics.connections_open.dec()
        super().connection_lost(exc)

    # ------------------------------------------------------------------ a client that does not read
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_stall is None:
            self._write_stall = self.loop.call_later(self.limits.write_timeout, self._write_timeout)
            self.limits.stalled[self] = None

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_stall()

    def _write_timeout(self) -> None:
        self.cut("write_timeout")  # still stalled: an abort
        self._write_stall = None

    def _cancel_write_stall(self) -> None:
        self.limits.stalled.pop(self, None)
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """uvicorn's graceful shutdown of this connection: a request whose body is still
        arriving has not reached the engine and is answered 503 now; whatever is still
        open a moment past the graceful timeout is cut."""
        self.loop.call_later(self.limits.stuck_after, self.cut, "shutdown")
        if self._body_arriving():
            self.cut("shutdown", 503, "the server is shutting down; retry on another replica or later",
                     {"retry-after": "1"})
        else:
            super().shutdown()

    # ------------------------------------------------------------------ the head's deadline
    def _await_request(self) -> None:
        """From now the client has --request-header-timeout seconds for a whole head."""
        self._cancel_deadline()
        self._awaited = self.cycle
        self._partial = False
        self.limits.receiving.pop(self, None)
        self.limits.waiting.pop(self, None)
        self.limits.waiting[self] = None
        self._deadline = self.loop.call_later(self.limits.header_timeout, self._header_timeout)

    def _track(self) -> None:
        """After input: a whole head in stops the clock (the body's own timeout is the
        app's) and the connection is no longer one waiting for its client; while its
        body arrives it is one of those that make room at the cap."""
        if self.cycle is self._awaited:
            self._partial = True
            return
        self._cancel_deadline()
        lim = self.limits
        lim.waiting.pop(self, None)
        if self._body_arriving():
            lim.receiving.setdefault(self, None)
        else:
            lim.receiving.pop(self, None)

    def _body_arriving(self) -> bool:
        """A request whose head is in and whose body is still coming, unanswered."""
        cycle = self.cycle
        return (cycle is not None and cycle is not self._awaited and not cycle.response_started
                and not cycle.disconnected and self.conn.their_state is h11.SEND_BODY)

    def _header_timeout(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.cycle is not self._awaited:
            return
        # a head under way is answered; an idle connection, or one still sending a body
        # nobody reads (after a 413, say), just closes
        if self._partial and self.conn.their_state is h11.IDLE:
            self.cut("header_timeout", 408, f"no whole request head within {self.limits.header_timeout:g} "
                                            f"seconds (--request-header-timeout)")
        else:
            self.cut("header_timeout")

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def cut(self, reason: str, status: int | None = None, message: str = "", headers: dict | None = None) -> None:
        """Close the connection for `reason` (counted in uniradix_connections_closed),
        answering `status` first where no response has begun. A cut while the client
        reads nothing is an abort: a close would wait for it to read what is unsent (so
        is a cut on shutdown, and a second cut of one already closed). The request under
        way, if any, learns that the server closed it."""
        if self._lost:
            return
        if self._closed_for is not None:  # closed before, and still not gone: its client reads nothing
            self.transport.abort()
            return
        self._closed_for = reason
        self.limits.metrics.connections_closed.labels(reason).inc()
        cycle = self.cycle
        if cycle is not None and cycle is not self._awaited and not cycle.response_complete:
            cycle.scope.setdefault("state", {})[CLOSED_BY_SERVER] = reason
        if status is not None and (cycle is None or cycle is self._awaited or not cycle.response_started):
            self.transport.write(raw_response(status, message, headers))
        self.close_now(abort=self._write_stall is not None or (reason == "shutdown" and status is None))

    def close_now(self, abort: bool = False) -> None:
        """Close the connection (`abort`: dropping what is unsent); it stops counting
        against the limit at once."""
        self._cancel_deadline()
        self.limits.waiting.pop(self, None)
        self.limits.receiving.pop(self, None)
        self.limits.stalled.pop(self, None)
        self.connections.discard(self)
        if abort:
            self.transport.abort()
        else:
            self.transport.close()
