"""The scheduler thread: the only thread that touches the engine once the server runs.

HTTP handlers hand it work through an inbox (submit, abort, a callable to run between
steps) and never wait for a step; it steps the engine while there is work and sends
each request's new tokens back to the event loop that asked (`Stream`). Sessions' idle
timeouts are enforced here too, between steps."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future

from ..engine import Engine, Request
from ..tree.keys import session_key
from .activity import ActivityLog, request_line
from .dashboard import History
from .request_log import salt_digest
from .sessions import Sessions
from .waitlist import Waitlist

log = logging.getLogger("uniradix.server")

#: the share of the graceful timeout kept, where there is an L3, for writing the cache
#: down after the running requests (at most the storage tier's io_timeout): requests
#: that run to the end would otherwise leave the write-down no time at all
WRITE_DOWN_SHARE = 0.25


class Stream:
    """One request's events for the event loop: (new output ids, done). The scheduler
    thread pushes; the handler awaits `get`."""

    def __init__(self, req: Request, loop: asyncio.AbstractEventLoop, client_id: str | None = None,
                 record: bool = False) -> None:
        self.req = req
        self.client_id = client_id  # the id the client knows the request by (rid), for the log
        self.record = record        # a turn SGLang's session continuation may continue from
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sent = 0
        self.last_token: float | None = None

    def push(self, ids: list[int], done: bool) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (ids, done))
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass

    async def get(self) -> tuple[list[int], bool]:
        return await self.queue.get()


class EngineRunner:
    """Owns the engine on one thread. `admit` is the HTTP side's queue bound: requests
    handed over and not yet started, beyond the batch's free places; those it refuses
    keep their places in line (`waitlist`). `waiting_timeout`: seconds a queued request
    may wait to start before it is aborted (a 503)."""

    def __init__(self, engine: Engine, metrics=None, session_timeout: float | None = None,
                 log_requests: bool = False, log_interval: float | None = None, request_log=None,
                 waiting_timeout: float | None = None) -> None:
        self.engine = engine
        self.waiting_timeout = waiting_timeout
        self.waitlist = Waitlist()  # under _wake, as the counts it is weighed against
        self.metrics = metrics
        self.log_requests = log_requests
        self.request_log = request_log  # request_log.RequestLog, or None
        self.activity = ActivityLog(engine, log_interval)
        self.history = None if metrics is None else History(metrics)  # the dashboard's last minutes
        self.sessions = Sessions(session_timeout)
        self.streams: dict[int, Stream] = {}
        self._inbox: deque = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._closed = False
        self.thread = threading.Thread(target=self._loop, name="uniradix-scheduler", daemon=True)
        self._inbox_submits = 0     # submits in the inbox (under _wake)
        self._engine_waiting = 0    # the engine's queues, as the thread last saw them
        self._running = 0
        self.output_tokens = 0
        self.failure: BaseException | None = None
        self.stop_deadline: float | None = None   # time.monotonic() the first stop asked to end by

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self.thread.start()

    def submit(self, stream: Stream) -> None:
        """Queue a prepared request (Engine.prepare has checked it; `admit` counted it)."""
        self._put(("submit", stream))

    def admit(self, n: int, limit: int, key: bytes | None = None) -> bool:
        """Whether n more requests keep the queue beyond the running batch within
        `limit`, the places kept for requests refused before (and asking again) left to
        them; if so they are counted as handed over at once (submit them next). Refused,
        the request known by `key` keeps its place in line for its retry."""
        with self._wake:
            free = max(0, self.engine.max_running - self._running)
            room = limit + free - self._inbox_submits - self._engine_waiting
            admitted = self.waitlist.admit(key, n, room, limit)
            if self.metrics is not None:
                self.metrics.waitlisted_requests.set(len(self.waitlist))
            if not admitted:
                return False
            self._inbox_submits += n
            return True

    def abort(self, req: Request) -> None:
        self._put(("abort", req))

    def call(self, fn) -> Future:
        """Run fn() on the scheduler thread between steps; its result in the future."""
        fut: Future = Future()
        self._put(("call", (fn, fut)))
        return fut

    async def run(self, fn):
        """`call` for coroutines; a 503 once the thread has stopped."""
        fut = self.call(fn)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if not fut.cancelled():
                raise  # the handler itself was cancelled
        from .protocol import BadRequest
        raise BadRequest("the server is shutting down", 503)

    def request_stop(self, timeout: float) -> None:
        """Refuse new requests from now, let running ones finish for up to `timeout`
        seconds (less WRITE_DOWN_SHARE of it where there is an L3), then abort the rest
        (their clients get an abort, not a cut), write the tiers down to L3 in what is
        left of `timeout` and end the thread. Returns at once (a signal handler calls it)."""
        deadline = time.monotonic() + timeout
        if self.stop_deadline is None:
            self.stop_deadline = deadline
        self._put(("stop", deadline))

    def stop(self, timeout: float = 30.0) -> None:
        """request_stop, then wait for the thread to end."""
        self.request_stop(timeout)
        if self.thread.is_alive():
            self.thread.join()

    def _put(self, item) -> None:
        with self._wake:
            if not self._closed:
                self._inbox.append(item)
                self._wake.notify()
                return
            if item[0] == "submit":
                self._inbox_submits -= 1
        kind, arg = item  # the thread has ended: nothing will run
        if kind == "submit":
            _refuse(arg)
        elif kind == "call":
            arg[1].cancel()

    # ------------------------------------------------------------------ scheduler thread
    def _loop(self) -> None:
        eng = self.engine
        deadline = drained = None
        try:
            while True:
                for kind, arg in self._drain():
                    if kind == "stop":
                        self._stopping = True
                        deadline = arg if deadline is None else min(deadline, arg)
                        drained = deadline - self._write_down_reserve(deadline)
                    else:
                        self._handle(kind, arg)
                if self._stopping and (not self._busy() or time.monotonic() >= drained):
                    break
                if self.waiting_timeout is not None:
                    self._expire_waiting()
                if self._busy():
                    eng.step()
                    self._emit()
                self.activity.tick()
                if self.history is not None:
                    self.history.tick(self.snapshot)   # never raises: only the dashboard would miss it
                self._expire_sessions()
        except BaseException as e:  # a bug in the engine: every stream ends with it
            self.failure = e
            log.exception("the scheduler thread failed")
        finally:
            self._shutdown(eng, deadline)

    def snapshot(self) -> dict:
        """One moment of the engine for /metrics and the dashboard (scheduler thread):
        its counters and gauges, the tokens sent, the sessions open."""
        return {"engine": self.engine.stats(), "output_tokens": self.output_tokens, "sessions": len(self.sessions)}

    def _write_down_reserve(self, deadline: float) -> float:
        """Seconds before the graceful deadline at which running requests are aborted,
        so that writing the cache down to L3 (Engine.close) still has time."""
        storage = self.engine.storage
        if storage is None:
            return 0.0
        return min(storage.io_timeout, WRITE_DOWN_SHARE * max(0.0, deadline - time.monotonic()))

    def _expire_waiting(self) -> None:
        """Requests still waiting to start --waiting-timeout seconds after they arrived
        are aborted (the client gets a 503 to retry, a stream an abort chunk); one that
        started (running, preempted since, or reading L3) is never timed out."""
        eng, limit = self.engine, self.waiting_timeout
        now = time.perf_counter()
        late = [st.owner for st in eng.waiting
                if st.owner.status == "waiting" and now - st.owner.metrics.arrival > limit]
        for req in late:
            eng.abort(req, f"it waited {limit:g} s in the queue without starting (--waiting-timeout); "
                           f"retry later")
            if self.metrics is not None:
                self.metrics.requests_refused.labels("waiting_timeout").inc()
        if late:
            self._emit()

    def _busy(self) -> bool:
        e = self.engine
        return bool(e.waiting or e.running or e.prefetching)

    def _drain(self) -> list:
        with self._wake:
            if not self._inbox and not self._busy():
                nd = self.sessions.next_deadline()
                self._wake.wait(timeout=1.0 if nd is None else max(0.0, min(1.0, nd - time.monotonic())))
            items = list(self._inbox)
            self._inbox.clear()
        return items

    def _handle(self, kind: str, arg) -> None:
        eng = self.engine
        if kind == "submit":
            with self._wake:
                self._inbox_submits -= 1
                self._engine_waiting += 1
            req = arg.req
            if self._stopping:
                _refuse(arg)
                return
            self.streams[req.rid] = arg
            if req.session_id is not None:
                if arg.record and not self.sessions.is_open(req.session_id, req.salt):
                    # its session closed since its context was read: it runs outside it,
                    # as a turn running at the close does, and never reopens it
                    req.session_id = None
                else:
                    self.sessions.begin(req.session_id, req.salt)
            eng.enqueue(req)
        elif kind == "abort":
            eng.abort(arg, "the client went away")
            self._emit()
        elif kind == "call":
            fn, fut = arg
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)

    def _emit(self) -> None:
        """New tokens to every stream that has some; the finished ones end (whatever
        ended them: a step, an abort, a failure at admission)."""
        now = time.perf_counter()
        for s in list(self.streams.values()):
            self._send(s, now)
        self._count_queues()

    def _count_queues(self) -> None:
        eng = self.engine
        with self._wake:
            self._engine_waiting, self._running = len(eng.waiting), len(eng.running) + len(eng.prefetching)

    def _send(self, s: Stream, now: float) -> None:
        req = s.req
        n = len(req.output_ids)
        if n == s.sent and not req.done:
            return
        new = req.output_ids[s.sent:n]
        m = self.metrics
        if new and m is not None:
            if s.sent == 0 and req.metrics.ttft is not None:
                m.ttft.observe(req.metrics.ttft)
            elif s.last_token is not None:
                gap = (now - s.last_token) / len(new)
                for _ in new:
                    m.itl.observe(gap)
        if new:
            s.last_token = now
        self.output_tokens += len(new)
        s.sent = n
        s.push(new, req.done)
        if req.done:
            del self.streams[req.rid]
            if req.session_id is not None:
                if s.record and req.status == "finished":
                    self.sessions.record(req.session_id, req.salt, s.client_id, req.input_ids, req.output_ids)
                self.sessions.end(req.session_id, req.salt)
            if m is not None:
                m.finished(req)
            if self.log_requests:
                log.info("%s", request_line(req, s.client_id))
            if self.request_log is not None:
                self.request_log.write(req, s.client_id)

    def _expire_sessions(self) -> None:
        for sid, salt in self.sessions.expired():
            self.close_session(sid, salt)

    def close_session(self, sid, salt=None) -> bool:
        """Drop the session `sid` of the tenant `salt` and its cache references (the
        scheduler thread's); another tenant's session of that id is another session.
        Its turns still running finish outside it: they leave no reference, and a
        session reopened under the same id is not theirs."""
        key = session_key(sid, salt)
        for s in self.streams.values():
            if s.req.session_id is not None and session_key(s.req.session_id, s.req.salt) == key:
                s.req.session_id = None
        known = self.sessions.close(sid, salt)
        closed = self.engine.close_session(sid, salt)
        if self.request_log is not None and (closed or known):
            self.request_log.event("close_session", session=sid, salt=salt_digest(salt))
        return closed or known

    def _shutdown(self, eng: Engine, deadline: float | None = None) -> None:
        for s in list(self.streams.values()):
            eng.abort(s.req, "the server is shutting down")
            self._send(s, time.perf_counter())
        with self._wake:
            self._closed = True
            items = list(self._inbox)
            self._inbox.clear()
        for kind, arg in items:
            if kind == "submit":
                _refuse(arg)
            elif kind == "call":
                arg[1].cancel()
        # what was handed to the store reaches it and the tiers are written down, within
        # what is left of the graceful timeout (at least the share the requests left it;
        # without a stop, the storage tier's own io_timeout): a store that hangs never
        # holds the process past it
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            eng.flush_writes(left)
            eng.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except Exception:
            log.exception("closing the engine failed")



def _refuse(s: Stream) -> None:
    """A request that arrived as the server stopped: aborted, never run."""
    req = s.req
    req.status, req.finish_reason, req.error = "aborted", "abort", "the server is shutting down"
    s.push([], True)
