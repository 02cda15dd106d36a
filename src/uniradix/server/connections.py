"""Limits on the HTTP connections themselves, below the application: how long a client
may take to send a request head, and how many connections may be open at once.

uvicorn closes an idle keep-alive connection, but a connection that never completes a
request head (a byte a second, or nothing at all after connecting) was held forever,
and once the process ran out of file descriptors new clients went unanswered. Here:

- a connection has `--request-header-timeout` seconds from when it opens, or from the
  end of its previous response, to send a whole request head; then it is closed (with
  a 408 if part of a head had come). The body has its own timeout, in the app's reader.
- at `--max-connections` a new connection first makes room by closing the one that
  has waited longest for a request head (idle, or a head trickling in); when every
  connection is busy with a request, the new one is answered 503 and closed at once.
- the cap, and how many connections the event loop accepts at one wake-up, are sized
  against the file descriptor limit at start-up, so the process never runs out of
  descriptors however many clients connect."""
from __future__ import annotations

import http
import json
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
    connections waiting for a request head, the longest waiting first."""

    def __init__(self, header_timeout: float, max_connections: int, metrics) -> None:
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.metrics = metrics
        self.waiting: dict = {}  # insertion order: the longest waiting first

    def make_room(self, newcomer) -> bool:
        """Close the connection that has waited longest for a request head; False if
        every open connection is busy with a request."""
        victim = next((c for c in self.waiting if c is not newcomer), None)
        if victim is None:
            return False
        self.metrics.connections_closed.labels("evicted").inc()
        victim.close_now()
        return True


def limited_protocol(limits: Limits) -> type:
    """uvicorn's h11 protocol with these limits (uvicorn.Config(http=...))."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})


class LimitedH11Protocol(H11Protocol):
    """A connection that must send each request head in time and that counts against
    --max-connections. `_awaited` is the request cycle that was current when waiting
    for the client began: a head has arrived once `cycle` is another."""

    limits: Limits

    def connection_made(self, transport) -> None:
        self._deadline = None
        self._awaited = None
        self._partial = False
        super().connection_made(transport)
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
        self._cancel_deadline()
        self.limits.waiting.pop(self, None)
        self.limits.metrics.connections_open.dec()
        super().connection_lost(exc)

    # ------------------------------------------------------------------ the head's deadline
    def _await_request(self) -> None:
        """From now the client has --request-header-timeout seconds for a whole head."""
        self._cancel_deadline()
        self._awaited = self.cycle
        self._partial = False
        self.limits.waiting.pop(self, None)
        self.limits.waiting[self] = None
        self._deadline = self.loop.call_later(self.limits.header_timeout, self._header_timeout)

    def _track(self) -> None:
        """After input: a whole head in stops the clock (the body's own timeout is the
        app's) and the connection is no longer one waiting for its client."""
        if self.cycle is self._awaited:
            self._partial = True
            return
        self._cancel_deadline()
        self.limits.waiting.pop(self, None)

    def _header_timeout(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.cycle is not self._awaited:
            return
        self.limits.metrics.connections_closed.labels("header_timeout").inc()
        # a head under way is answered; an idle connection, or one still sending a body
        # nobody reads (after a 413, say), just closes
        if self._partial and self.conn.their_state is h11.IDLE:
            self.transport.write(raw_response(408, f"no whole request head within {self.limits.header_timeout:g} "
                                                   f"seconds (--request-header-timeout)"))
        self.close_now()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def close_now(self) -> None:
        """Close the connection; it stops counting against the limit at once."""
        self._cancel_deadline()
        self.limits.waiting.pop(self, None)
        self.connections.discard(self)
        self.transport.close()
