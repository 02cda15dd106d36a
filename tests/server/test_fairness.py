"""Overload is fair: a request refused at a full queue keeps its place in line, so a
client that keeps retrying is served in the order it was first refused, whoever asks
first when a place frees; a queued request waits until it runs or its --waiting-timeout;
a request the server could never queue is a 400 at once. The waitlist's order and
bounds are also driven directly, without HTTP."""
import asyncio
import http.client
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_proc import ServerProc

from uniradix.engine import Request, SamplingParams
from uniradix.server.runner import EngineRunner, Stream
from uniradix.server.waitlist import Waitlist

HANG = 120.0  # seconds: only a hang takes this long


def prompt(i: int) -> list[int]:
    """A short prompt of its own (no two share a prefix worth holding for)."""
    return [10 + i % 200, 11 + i // 200, 5, 6, 7]


def long_body(i: int) -> dict:
    return {"input_ids": prompt(i), "stream": True,
            "sampling_params": {"max_new_tokens": 15000, "temperature": 0, "ignore_eos": True}}


class Streamed:
    """A streamed /generate: its status arrives when the server takes or refuses it
    (the queue's decision, before any token); a taken one is read in the background
    until `cut` closes it (the server then aborts it)."""

    def __init__(self, srv: ServerProc, body: dict) -> None:
        self.conn = srv.conn(timeout=HANG)
        self.conn.request("POST", "/generate", body=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        self.status, self.headers = resp.status, {k.lower(): v for k, v in resp.getheaders()}
        self.body = b""
        if self.status == 200:
            self.reader = threading.Thread(target=self._drain, args=(resp,), daemon=True)
            self.reader.start()
        else:
            self.body = resp.read()
            self.conn.close()

    @staticmethod
    def _drain(resp) -> None:
        try:
            while resp.read(65536):
                pass
        except (OSError, ValueError, AttributeError, http.client.HTTPException):
            return  # cut: the connection closed under the read

    def cut(self) -> None:
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conn.close()


def wait_queues(srv: ServerProc, running: int, waiting: int) -> None:
    deadline = time.monotonic() + HANG
    while True:
        m = srv.metrics()
        if (m["uniradix_running_requests"], m["uniradix_waiting_requests"]) == (running, waiting):
            return
        assert time.monotonic() < deadline, f"never {running} running and {waiting} waiting: {m}"
        time.sleep(0.02)


def test_a_freed_place_goes_to_the_request_refused_longest_ago():
    """32 clients refused in turn at a full queue; then, each time one place frees, all of
    them retry, the one refused last asking first. The place goes to the one refused
    longest ago every time: client i is refused exactly i + 1 times (once on arrival,
    then once for each client ahead of it), whatever the order the retries come in."""
    clients = 32
    s = ServerProc("--max-running-requests", "1", "--max-queued-requests", "1")
    taken = []
    try:
        taken += [Streamed(s, long_body(1000)), Streamed(s, long_body(1001))]
        assert [t.status for t in taken] == [200, 200]
        wait_queues(s, 1, 1)    # one running, one queued: the queue is full
        refusals = [0] * clients
        for i in range(clients):
            r = Streamed(s, long_body(i))
            assert r.status == 503 and r.headers.get("retry-after") == "1", (i, r.status, r.body)
            assert b"--max-queued-requests" in r.body, r.body
            refusals[i] += 1
        served: list[int] = []
        for rnd in range(clients):
            taken[rnd].cut()    # the running request goes; the queued one runs; one place frees
            wait_queues(s, 1, 0)
            for i in reversed([i for i in range(clients) if i not in served]):
                r = Streamed(s, long_body(i))
                if r.status == 200:
                    served.append(i)
                    taken.append(r)
                else:
                    assert r.status == 503 and r.headers.get("retry-after") == "1", (i, r.status, r.body)
                    refusals[i] += 1
            assert served == list(range(rnd + 1)), f"round {rnd}: served in the order {served}"
        assert refusals == [i + 1 for i in range(clients)], refusals
        m = s.metrics()
        assert m['uniradix_requests_refused_total{reason="queue_full"}'] == sum(refusals)
    finally:
        for t in taken:
            t.cut()
        s.wait_idle(HANG)
        assert s.audit()["settled"]
        assert s.stop() == 0


@pytest.mark.parametrize("clients, per", [(40, 2), pytest.param(100, 6, marks=pytest.mark.slow)])
def test_many_retrying_clients_are_all_served(clients, per):
    """Many clients, each sending requests one after the other and retrying each on 503
    (a short random backoff) against 2 running places, a queue of 4 and small pools:
    every request is served, exactly, and every refusal is counted. The figures are
    printed (-s); the slow case is the shape of the load that found the starvation (100
    clients, 600 requests)."""
    new = 6
    s = ServerProc("--max-running-requests", "2", "--max-queued-requests", "4", "--max-total-tokens", "1024")
    lock = threading.Lock()
    refused: list[int] = []
    outputs = {}

    def client(c: int) -> None:
        rng = random.Random(c)
        conn = s.conn(timeout=HANG)
        try:
            for k in range(per):
                body = {"input_ids": prompt(c * per + k) + [rng.randrange(20, 200) for _ in range(20)],
                        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
                n = 0
                deadline = time.monotonic() + 4 * HANG
                while True:
                    conn.request("POST", "/generate", body=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
                    r = conn.getresponse()
                    out = json.loads(r.read())
                    if r.status == 200:
                        break
                    assert r.status == 503 and r.getheader("retry-after") == "1", (r.status, out)
                    assert time.monotonic() < deadline, f"client {c} was refused {n} times and never served"
                    n += 1
                    time.sleep(rng.uniform(0.01, 0.05))
                with lock:
                    refused.append(n)
                    outputs[(c, k)] = out["output_ids"]
        finally:
            conn.close()

    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, range(clients)))
        wall = time.monotonic() - t0
        assert len(outputs) == clients * per and all(len(o) == new for o in outputs.values())
        m = s.wait_idle(HANG)
        assert m['uniradix_requests_refused_total{reason="queue_full"}'] == sum(refused)
        assert m["uniradix_requests_failed_total"] == 0
        assert s.audit()["settled"]
        print(f"\n{clients} clients x {per} requests in {wall:.1f} s: {sum(refused)} refusals, "
              f"at most {max(refused)} for one request, {sum(1 for n in refused if n)} requests refused at least once")
    finally:
        assert s.stop() == 0


def test_a_queued_request_waits_until_its_waiting_timeout_then_503():
    """Queued behind a request that runs on, a whole request and a streamed one wait
    --waiting-timeout seconds (SGLang's SGLANG_REQ_WAITING_TIMEOUT), then end: the whole
    one with 503 and Retry-After naming the setting, the stream with an abort chunk; a
    request that started is never timed out. The queue's bound under its old name
    (--max-waiting-requests) still sets it, and a batch larger than the server ever
    queues is a 400 at once."""
    s = ServerProc("--max-running-requests", "1", "--waiting-timeout", "1", "--max-waiting-requests", "3")
    holder = None
    try:
        code, info, _ = s.get("/get_server_info")
        assert code == 200 and info["max_queued_requests"] == 3 and info["waiting_timeout"] == 1
        code, out, _ = s.post("/generate", {"input_ids": [[5, 6]] * 5, "sampling_params": {"max_new_tokens": 1}})
        assert code == 400 and "--max-queued-requests" in out["error"]["message"], out
        holder = Streamed(s, long_body(0))
        assert holder.status == 200
        wait_queues(s, 1, 0)
        code, out, headers = s.post("/generate", {"input_ids": prompt(1), "sampling_params": {"max_new_tokens": 2}})
        assert code == 503 and headers.get("retry-after") == "1", (code, out)
        assert "--waiting-timeout" in out["error"]["message"], out
        events = list(s.stream("/generate", {"input_ids": prompt(2), "stream": True,
                                            "sampling_params": {"max_new_tokens": 2}}))
        assert events[-1] == "[DONE]"
        final = events[-2]["meta_info"]["finish_reason"]
        assert final["type"] == "abort" and "--waiting-timeout" in final["message"], events[-2]
        m = s.metrics()
        assert m['uniradix_requests_refused_total{reason="waiting_timeout"}'] == 2
        assert m["uniradix_running_requests"] == 1   # the holder ran on past the timeout
    finally:
        if holder is not None:
            holder.cut()
        s.wait_idle(HANG)
        assert s.audit()["settled"]
        assert s.stop() == 0


# ---------------------------------------------------------------------------- without HTTP
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_waitlist_gives_freed_places_in_the_order_of_first_refusal():
    w = Waitlist(clock=Clock())
    for k in (b"a", b"b", b"c"):
        assert not w.admit(k, 1, room=0, limit=4)
    assert w.order() == [b"a", b"b", b"c"]
    assert not w.admit(b"c", 1, room=1, limit=4)      # one place: a's
    assert not w.admit(b"b", 1, room=1, limit=4)
    assert not w.admit(b"new", 1, room=1, limit=4)    # a newcomer goes last
    assert w.order() == [b"a", b"b", b"c", b"new"]
    assert w.admit(b"a", 1, room=1, limit=4)
    assert not w.admit(b"new", 1, room=2, limit=4)    # two places: b's and c's
    assert w.admit(b"c", 1, room=2, limit=4)          # c's, b's still kept
    assert not w.admit(b"new", 1, room=1, limit=4)
    assert w.admit(b"b", 1, room=1, limit=4)
    assert w.order() == [b"new"]


def test_the_waitlist_holds_the_queues_places_never_the_batchs():
    """However many were refused, they hold at most the queue's places (`limit`): with
    the batch's places free, a newcomer runs at once; the line's order still holds
    among those the queue's places are kept for."""
    w = Waitlist(clock=Clock())
    for i in range(50):
        assert not w.admit(bytes([i]), 1, room=0, limit=4)
    assert not w.admit(b"new", 1, room=4, limit=4)    # 4 places free: the first four's
    assert w.admit(b"new2", 1, room=5, limit=4)       # a 5th (a batch place): anyone's
    assert w.admit(bytes([49]), 1, room=5, limit=4)   # ... the last refused too
    assert not w.admit(bytes([10]), 1, room=4, limit=4)
    assert w.admit(bytes([0]), 1, room=4, limit=4)


def test_a_batch_at_the_head_of_the_line_is_not_overtaken_by_single_requests():
    """A batch of 6 prompts against a queue of 4 needs batch places too: the line keeps
    all 6 for it, so the single requests that keep coming never starve it."""
    w = Waitlist(clock=Clock())
    assert not w.admit(b"batch", 6, room=3, limit=4)
    for room in range(1, 6):
        assert not w.admit(b"single", 1, room=room, limit=4)
        assert not w.admit(b"batch", 6, room=room, limit=4)
    assert w.admit(b"batch", 6, room=6, limit=4)
    assert w.admit(b"single", 1, room=1, limit=4)


def test_a_place_is_kept_while_its_client_retries_and_lapses_when_it_stops():
    clock = Clock()
    w = Waitlist(keep_s=30.0, clock=clock)
    assert not w.admit(b"gone", 1, room=0, limit=2)
    assert not w.admit(b"back", 1, room=0, limit=2)
    for _ in range(5):                               # back retries every 10 s; gone never does
        clock.t += 10.0
        assert not w.admit(b"back", 1, room=0, limit=2)
    assert w.order() == [b"back"]
    assert w.admit(b"back", 1, room=1, limit=2)
    assert w.admit(None, 1, room=1, limit=2) and len(w) == 0


def test_the_waitlist_is_bounded():
    w = Waitlist(max_entries=3, clock=Clock())
    for i in range(10):
        assert not w.admit(bytes([i]), 1, room=0, limit=1)
    assert w.order() == [b"\x00", b"\x01", b"\x02"]


def test_the_runner_keeps_a_refused_requests_place_between_steps(make_engine):
    """EngineRunner.admit against a stepping engine: with the batch (1) and the queue
    (1) full, the request refused first is taken first once a place frees, though a
    newer one asks before it."""
    eng = make_engine(max_running_requests=1, max_total_tokens=512)
    runner = EngineRunner(eng)
    loop = asyncio.new_event_loop()
    try:
        short = [Stream(Request(input_ids=prompt(i), sampling=SamplingParams(max_new_tokens=2)), loop)
                 for i in range(2)]
        for i, st in enumerate(short):
            assert eng.prepare(st.req) is None and runner.admit(1, 1, key=b"short%d" % i)
            runner._handle("submit", st)
        assert not runner.admit(1, 1, key=b"first")
        assert not runner.admit(1, 1, key=b"second")
        while not short[0].req.done:
            eng.step()
            runner._emit()
        assert not runner.admit(1, 1, key=b"second")
        assert runner.admit(1, 1, key=b"first")
        while not short[1].req.done:
            eng.step()
            runner._emit()
    finally:
        loop.close()
