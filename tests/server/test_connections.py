"""Slow and idle clients: a connection must send its request head within
--request-header-timeout and its body within --request-body-timeout or it is cut; at
--max-connections the connection waiting longest for a head makes room for a new one,
and with every connection busy a new one is refused at once. Through it all a normal
client gets its answer. (A client that leaves mid-body: test_robustness.py.)"""
import json
import socket
import threading
import time

import pytest
from server_proc import HANG_S, ServerProc

HEAD_S = 2.0
CAP = 3
GOOD = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def srv():
    s = ServerProc("--request-header-timeout", str(HEAD_S), "--request-body-timeout", str(HEAD_S),
                   "--max-connections", str(CAP), "--max-running-requests", "4")
    yield s
    assert s.stop() == 0, "".join(s.lines[-30:])


def connect(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(30)
    return s


def read_until_closed(sock: socket.socket) -> bytes:
    """What the server sent before it closed the connection (a reset counts as closed)."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    sock.close()
    return got


def trickle(sock: socket.socket, stop: threading.Event) -> None:
    """A slowloris: a request head one byte at a time, never finished."""
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 1000
    for b in head:
        if stop.wait(0.2):
            return
        try:
            sock.send(bytes([b]))
        except OSError:
            return


def counters(srv) -> dict:
    m = srv.metrics()
    return {k.split("{")[0].removeprefix("uniradix_") + (k[k.find("{"):] if "{" in k else ""): v
            for k, v in m.items() if "connections" in k or "disconnects" in k}


def test_slow_clients_are_cut_and_a_normal_client_gets_through(srv):
    before = counters(srv)
    stop = threading.Event()
    idle = [connect(srv) for _ in range(2)]           # connect, then say nothing
    slow = []
    for _ in range(3):                                # trickle a head a byte at a time
        s = connect(srv)
        threading.Thread(target=trickle, args=(s, stop), daemon=True).start()
        slow.append(s)
        time.sleep(0.05)
    try:
        code, out, _ = srv.post("/generate", GOOD)    # five slow ones hold the cap of three
        assert code == 200 and len(out["output_ids"]) == 2
        answers = [read_until_closed(s) for s in idle + slow]   # every one is cut, none hangs
    finally:
        stop.set()
    assert all(a == b"" or a.startswith(b"HTTP/1.1 408") for a in answers), answers
    assert b"--request-header-timeout" in answers[-1]  # the newest is never the one evicted
    after = counters(srv)
    cut = sum(after[f'connections_closed_total{{reason="{r}"}}'] - before[f'connections_closed_total{{reason="{r}"}}']
              for r in ("header_timeout", "evicted"))
    assert cut == 5
    assert after['connections_closed_total{reason="evicted"}'] > before['connections_closed_total{reason="evicted"}']
    assert after["connections_refused_total"] == before["connections_refused_total"]


def test_a_body_that_does_not_come_is_408(srv):
    before = counters(srv)
    s = connect(srv)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
              b'{"input_ids"')
    answer = read_until_closed(s)  # the server answers, then closes
    assert answer.startswith(b"HTTP/1.1 408"), answer
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert "--request-body-timeout" in body["error"]["message"] and body["error"]["code"] == 408
    after = counters(srv)
    key = 'connections_closed_total{reason="body_timeout"}'
    assert after[key] == before[key] + 1
    assert srv.post("/generate", GOOD)[0] == 200


def test_at_the_cap_with_every_connection_busy_a_new_one_is_refused(srv):
    srv.wait_idle()
    before = counters(srv)
    body = json.dumps({"input_ids": [5, 6, 7], "stream": True,
                       "sampling_params": {"max_new_tokens": 10000, "temperature": 0, "ignore_eos": True}}).encode()
    busy = []
    for _ in range(CAP):
        s = connect(srv)
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"data: " not in got:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
        busy.append(s)
    extra = connect(srv)
    try:
        answer = read_until_closed(extra)  # 503 and closed at once (or a reset), never held
        assert answer == b"" or answer.startswith(b"HTTP/1.1 503"), answer
    finally:
        for s in busy:
            s.close()
    srv.wait_idle()
    after = counters(srv)
    assert after["connections_refused_total"] == before["connections_refused_total"] + 1
    assert srv.audit()["settled"]


def test_the_cap_and_the_accept_bursts_fit_the_file_descriptor_limit(monkeypatch):
    import resource

    from uniradix.server import connections as c
    limits = {"now": (1024, 1024)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, v: limits.update(now=v))
    monkeypatch.setattr(c, "_open_fds", lambda: 40)

    def fits(b) -> bool:  # open connections and sockets being accepted, beside what the process holds
        return 40 + c.FD_RESERVE + b.max_connections + c.BURSTS_IN_FLIGHT * b.backlog <= limits["now"][0]
    default = c.connection_budget(None)
    assert 100 < default.max_connections < 1024 and default.backlog >= 16 and fits(default)  # shrunk to fit
    assert c.connection_budget(default.max_connections).max_connections == default.max_connections
    with pytest.raises(ValueError, match=r"--max-connections 2000 .*ulimit -n"):
        c.connection_budget(2000)
    limits["now"] = (256, 65536)  # a short soft limit is raised as far as needed
    big = c.connection_budget(None)
    assert big.max_connections == 1024 and limits["now"][0] > 256 and fits(big)
    limits["now"] = (150, 150)  # no room at all
    with pytest.raises(ValueError, match="ulimit -n"):
        c.connection_budget(None)


def test_under_a_low_file_descriptor_limit_a_normal_client_still_gets_through():
    """Before: past the limit asyncio's accept failed in a storm of errors and new
    clients went unanswered until the idle ones left."""
    s = ServerProc("--max-running-requests", "2", nofile=256)
    held = []
    try:
        for _ in range(300):  # idle connections, far past what the server may hold
            try:
                held.append(socket.create_connection(("127.0.0.1", s.port), timeout=10))
            except OSError:
                break
            time.sleep(0.003)  # paced: a full listen queue would only slow the test (SYN retries)
        c = s.conn()
        try:
            c.request("POST", "/generate", body=json.dumps(GOOD), headers={"Content-Type": "application/json"})
            assert c.getresponse().status == 200
        finally:
            c.close()
        assert s.get("/get_server_info")[1]["max_connections"] < 256
    finally:
        for h in held:
            h.close()
        assert s.stop() == 0
    log = "".join(s.lines)
    assert "Too many open files" not in log and "out of system resource" not in log, log[-3000:]


# ---------------------------------------------------------------------------- clients stuck on their side
def send_head_and_part_of_a_body(srv) -> socket.socket:
    """A request whose handler is reading its body (it asked for it: 100 Continue)."""
    s = connect(srv)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
              b"Expect: 100-continue\r\n\r\n")
    got = b""
    while b"100 Continue" not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    s.sendall(b"{")
    return s


def logged(srv, since: int, text: str, n: int) -> str:
    """The server's output since line `since`, once `text` is in it `n` times (log lines
    reach stdout through the masking relay, a moment after what they tell)."""
    deadline = time.monotonic() + HANG_S
    while True:
        new = "".join(srv.lines[since:])
        if new.count(text) >= n or time.monotonic() > deadline:
            return new
        time.sleep(0.05)


def server_send_queue(port: int, client_port: int) -> int | None:
    """Bytes the server's socket to this client holds unsent (Linux's /proc/net/tcp)."""
    try:
        with open("/proc/net/tcp") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return None
    for row in rows:
        cols = row.split()
        if int(cols[1].split(":")[1], 16) == port and int(cols[2].split(":")[1], 16) == client_port:
            return int(cols[4].split(":")[0], 16)
    return None


def a_client_that_never_reads(srv) -> socket.socket:
    """Pipelined requests whose answers it never reads, until the server's writes to it
    are stuck (its socket full)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", srv.port))

    def flood():
        try:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 3000)  # ~35 MB of answers
        except OSError:
            pass
    threading.Thread(target=flood, daemon=True).start()
    last, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline:  # stuck: the server's unsent bytes stay put
        time.sleep(0.3)
        now = server_send_queue(srv.port, s.getsockname()[1])
        if now is None and last is None and time.monotonic() > deadline - 27:
            break  # no /proc/net/tcp here: 3 s is far more than filling the buffers takes
        if now and now == last:
            break
        last = now
    return s


def test_at_the_cap_a_client_still_sending_its_body_makes_room(srv):
    """Before: connections whose body trickled in held every place until
    --request-body-timeout, and a normal client was refused (503) all that time."""
    srv.wait_idle()
    before = counters(srv)
    slow = [send_head_and_part_of_a_body(srv) for _ in range(CAP)]  # reading bodies, not waiting for heads
    try:
        code, out, _ = srv.post("/generate", GOOD)
        assert code == 200 and len(out["output_ids"]) == 2, out
        first = read_until_closed(slow[0])  # the one that has sent its body longest goes
        assert first.startswith(b"HTTP/1.1 503"), first
        assert b"--max-connections" in first and b"retry-after" in first.lower()
    finally:
        for s in slow[1:]:
            s.close()
    deadline = time.monotonic() + HANG_S
    while counters(srv)["client_disconnects_total"] < before["client_disconnects_total"] + 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = counters(srv)
    # the two closed here left; the one closed by the server is counted as evicted, not as a client leaving
    assert after["client_disconnects_total"] == before["client_disconnects_total"] + 2
    key = 'connections_closed_total{reason="evicted"}'
    assert after[key] == before[key] + 1
    assert after["connections_refused_total"] == before["connections_refused_total"]


def test_at_the_cap_a_client_that_reads_nothing_makes_room(srv):
    """Before: connections whose clients read none of their answers held every place,
    and a normal client was refused (503) for as long as they stayed."""
    srv.wait_idle()
    before = counters(srv)
    stuck = [a_client_that_never_reads(srv) for _ in range(CAP)]
    try:
        code, out, _ = srv.post("/generate", GOOD)
        assert code == 200 and len(out["output_ids"]) == 2, out
    finally:
        for s in stuck:
            s.close()
    after = counters(srv)
    key = 'connections_closed_total{reason="evicted"}'
    assert after[key] == before[key] + 1
    assert after["connections_refused_total"] == before["connections_refused_total"]
    srv.wait_idle()
    assert srv.audit()["settled"]


LONG = {"max_new_tokens": 5000, "temperature": 0, "ignore_eos": True}
LEAVING = {
    "generate-stream": ("/generate", {"input_ids": [5, 6, 7], "stream": True, "sampling_params": LONG}, 1),
    "generate-batch": ("/generate", {"input_ids": [[5, 6, 7], [5, 6, 8]], "sampling_params": LONG}, 2),
    "completions-stream": ("/v1/completions", {"prompt": [5, 6, 7], "stream": True, "max_tokens": 5000,
                                               "ignore_eos": True}, 1),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000,
                                      "ignore_eos": True}, 1),
}


@pytest.mark.parametrize("case", LEAVING)
def test_a_client_that_leaves_after_its_body_is_counted_and_logged_once(srv, case):
    """Before: only a client that left mid-body was counted and logged; one that left
    mid-stream or while waiting for a whole answer was aborted without a word."""
    path, body, prompts = LEAVING[case]
    srv.wait_idle()
    before, aborted, lines = counters(srv), srv.metrics()["uniradix_requests_aborted_total"], len(srv.lines)
    raw = json.dumps(body).encode()
    s = connect(srv)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    if body.get("stream"):
        got = b""
        while got.count(b"data: ") < 2:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
    else:
        deadline = time.monotonic() + HANG_S
        while srv.metrics()["uniradix_running_requests"] < prompts:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    s.close()
    deadline = time.monotonic() + HANG_S
    while counters(srv)["client_disconnects_total"] == before["client_disconnects_total"]:
        assert time.monotonic() < deadline, "not counted"
        time.sleep(0.05)
    srv.wait_idle()
    assert counters(srv)["client_disconnects_total"] == before["client_disconnects_total"] + 1
    assert srv.metrics()["uniradix_requests_aborted_total"] == aborted + prompts
    assert srv.audit()["settled"]
    new = logged(srv, lines, "left during its request", 1)
    left = [line for line in new.splitlines() if "left during its request" in line]
    assert len(left) == 1 and " INFO " in left[0] and path in left[0], new
    assert "Traceback" not in new and "ERROR" not in new, new


def test_what_a_client_gets_wrong_below_the_app_is_counted_and_logged_at_info(srv):
    """Before: uvicorn logged a WARNING for every connection that sent bytes that are not
    HTTP, and two (one advising to install a WebSocket library) for every Upgrade
    header, none of it counted: any client could fill the log with warnings."""
    before, lines = counters(srv), len(srv.lines)
    for _ in range(3):
        s = connect(srv)
        s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http\r\n\r\n")
        assert read_until_closed(s).startswith(b"HTTP/1.1 400")
    s = connect(srv)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got:
        got += s.recv(4096)
    s.close()
    assert got.startswith(b"HTTP/1.1 200")  # served as a plain request
    key = 'connections_closed_total{reason="bad_request"}'
    assert counters(srv)[key] == before[key] + 3
    assert srv.post("/generate", GOOD)[0] == 200
    new = logged(srv, lines, "Unsupported upgrade request.", 1)
    new = logged(srv, lines, "Invalid HTTP request received.", 3)
    assert "WARNING" not in new and "WebSocket" not in new, new
    assert new.count("Invalid HTTP request received.") == 3 and new.count("Unsupported upgrade request.") == 1


def test_a_client_that_does_not_read_its_answers_is_cut():
    """Before: a client that sent requests and read nothing held its connection, its
    place under --max-connections and the handler forever."""
    s = ServerProc("--response-write-timeout", "1", "--max-connections", "4")
    try:
        before = counters(s)
        stuck = a_client_that_never_reads(s)
        key = 'connections_closed_total{reason="write_timeout"}'
        deadline = time.monotonic() + HANG_S
        while counters(s)[key] == before[key]:
            assert time.monotonic() < deadline, counters(s)
            time.sleep(0.1)
        assert counters(s)[key] == before[key] + 1
        stuck.close()
        assert s.post("/generate", GOOD)[0] == 200
        assert s.audit()["settled"]
    finally:
        assert s.stop() == 0
    log = "".join(s.lines)
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_sigterm_with_clients_stuck_on_their_side_stops_quietly():
    """Before: a client sending its body slowly, or reading nothing, held the shutdown
    past --graceful-timeout until uvicorn cancelled their handlers, one ERROR and a
    traceback each. Now a body still arriving is answered 503 at once, and what is
    still stuck a moment after the graceful timeout is cut."""
    s = ServerProc("--graceful-timeout", "1", "--request-body-timeout", "300")
    sending = send_head_and_part_of_a_body(s)
    reading_nothing = a_client_that_never_reads(s)
    try:
        assert s.stop() == 0
        answer = read_until_closed(sending)
        assert answer.startswith(b"HTTP/1.1 503") and b"shutting down" in answer, answer
    finally:
        reading_nothing.close()
    log = "".join(s.lines)
    assert "Traceback" not in log and "ERROR" not in log and "left during" not in log, log[-3000:]
