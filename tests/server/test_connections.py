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
from server_proc import ServerProc

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
        c = s.conn(timeout=20)
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
