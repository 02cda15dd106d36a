"""The Redis L3 backend against a real redis-server on 127.0.0.1 (started and stopped by
the tests, see redis_server.py): byte-exact round trips, leading-run exists, replace,
delete, clear by prefix, sharing between instances, bad keys and settings, the server
down at start, killed mid-run, out of memory, and unresponsive, and the counters."""
from __future__ import annotations

import hashlib
import logging
import random
import sys
import threading
import time

import pytest
from redis_server import free_port, redis_server

pytest.importorskip("redis", reason="pip install redis (in the test extra)")

from uniradix.hicache.backends.redis import RedisBackend
from uniradix.hicache.storage import StorageUnavailable

BOUND_S = 30.0   # a guard only: every failing call must return, well within this


def key(i, suffix: str = "") -> str:
    h = hashlib.sha256(str(i).encode()).hexdigest()
    return h + (f".{suffix}" if suffix else "")


def keys(n, start=0, suffix="") -> list[str]:
    return [key(i, suffix) for i in range(start, start + n)]


@pytest.fixture(scope="module")
def srv():
    with redis_server() as s:
        yield s


_prefix_no = iter(range(10**9))


@pytest.fixture
def prefix():
    """A prefix no other test uses, so tests on the shared server do not meet."""
    return f"t{next(_prefix_no)}:"


@pytest.fixture
def backend(srv, prefix):
    with RedisBackend(srv.url, prefix=prefix) as b:
        yield b


# --------------------------------------------------------------------------- round trips
def test_round_trip_is_byte_exact(backend):
    rng = random.Random(1)
    values = [b"", rng.randbytes(1 << 20), b"\x00\r\n$-1\r\n*0\r\n\xff" * 3, bytes(range(256))]
    ks = keys(len(values))
    assert backend.batch_set(ks, values) == [True] * len(values)
    got = backend.batch_get(ks)
    assert [type(g) for g in got] == [bytes] * len(values)
    assert got == values
    assert got[0] == b""   # empty is stored, not a miss


def test_many_keys_keep_order_and_misses_are_none(backend):
    rng = random.Random(2)
    ks = keys(300) + keys(300, suffix="swa") + keys(100, suffix="mamba_3")
    values = [rng.randbytes(rng.randrange(0, 3000)) for _ in ks]
    assert all(backend.batch_set(ks, values))
    absent = keys(50, start=10_000)
    query = [k for pair in zip(ks, absent) for k in pair] + ks[50:]
    want = dict(zip(ks, values))
    assert backend.batch_get(query) == [want.get(k) for k in query]
    assert backend.batch_get([]) == [] and backend.batch_set([], []) == []


def test_bytearray_and_memoryview_values(backend):
    ks = keys(2)
    assert backend.batch_set(ks, [bytearray(b"ab"), memoryview(b"cd")]) == [True, True]
    assert backend.batch_get(ks) == [b"ab", b"cd"]
    with pytest.raises(TypeError, match="bytes"):
        backend.batch_set(keys(1), ["text"])
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        backend.batch_set(keys(2), [b"x"])


# --------------------------------------------------------------------------- exists
def test_batch_exists_is_the_leading_run(backend):
    ks = keys(10)
    assert backend.batch_exists(ks) == 0                       # none
    assert backend.batch_exists([]) == 0
    backend.batch_set(ks, [b"v"] * 10)
    assert backend.batch_exists(ks) == 10                      # all
    backend.delete(ks[4])
    assert backend.batch_exists(ks) == 4                       # absent in the middle
    assert backend.batch_exists(ks[5:]) == 5                   # the rest is there
    assert backend.batch_exists([key(999)] + ks[:3]) == 0      # first absent
    assert backend.batch_exists(ks[:3] + [key(999)] + ks[5:]) == 3


# --------------------------------------------------------------------------- set, delete
def test_set_replaces(backend):
    k = [key(7)]
    assert backend.batch_set(k, [b"old value, longer"]) == [True]
    assert backend.batch_set(k, [b"new"]) == [True]
    assert backend.batch_get(k) == [b"new"]
    assert backend.batch_set(k, [b""]) == [True]
    assert backend.batch_get(k) == [b""]


def test_delete(backend):
    ks = keys(3)
    backend.batch_set(ks, [b"a", b"b", b"c"])
    assert backend.delete(ks[1]) is True
    assert backend.delete(ks[1]) is False
    assert backend.delete(key(12345)) is False
    assert backend.batch_get(ks) == [b"a", None, b"c"]


# --------------------------------------------------------------------------- clear, sharing
def test_clear_removes_only_its_own_prefix(srv):
    import redis
    raw = redis.Redis.from_url(srv.url)
    try:
        # "c[1]*:" has glob characters; "c[1]*:sub:" starts with it but is another prefix.
        with RedisBackend(srv.url, prefix="c[1]*:") as a, \
                RedisBackend(srv.url, prefix="c[1]*:sub:") as nested, \
                RedisBackend(srv.url, prefix="c[2]*:") as other:
            n = 2500  # more than one SCAN step and one DEL batch
            assert all(a.batch_set(keys(n) + keys(5, suffix="x"), [b"a"] * (n + 5)))
            assert all(nested.batch_set(keys(20), [b"n"] * 20))
            assert all(other.batch_set(keys(20), [b"o"] * 20))
            raw.set("c[1]*:not-a-key", b"foreign")       # not a storage key: left alone
            raw.set("c1xyz:" + key(0), b"glob-lookalike")   # would match an unescaped glob
            a.clear()
            assert a.batch_exists(keys(n)) == 0 and a.batch_get(keys(5, suffix="x")) == [None] * 5
            assert nested.batch_get(keys(20)) == [b"n"] * 20
            assert other.batch_get(keys(20)) == [b"o"] * 20
            assert raw.get("c[1]*:not-a-key") == b"foreign"
            assert raw.get("c1xyz:" + key(0)) == b"glob-lookalike"
            a.clear()   # clearing nothing is fine
            nested.clear()
            other.clear()
            assert nested.batch_exists(keys(20)) == 0 and other.batch_exists(keys(20)) == 0
    finally:
        raw.delete("c[1]*:not-a-key", "c1xyz:" + key(0))
        raw.close()


def test_two_instances_share_the_store(srv, prefix):
    with RedisBackend(srv.url, prefix=prefix) as e1, RedisBackend(srv.url, prefix=prefix) as e2:
        rng = random.Random(3)
        values = [rng.randbytes(4096) for _ in range(8)]
        assert all(e1.batch_set(keys(8), values))
        assert e2.batch_exists(keys(8)) == 8
        assert e2.batch_get(keys(8)) == values
        assert e2.delete(key(0))
        assert e1.batch_exists(keys(8)) == 0 and e1.batch_exists(keys(7, start=1)) == 7
        e2.clear()
        assert e1.batch_get(keys(8)) == [None] * 8


def test_threads_share_one_backend(backend):
    errors = []

    def work(t):
        try:
            ks = keys(50, start=1000 * t)
            vals = [f"{t}:{i}".encode() for i in range(50)]
            for _ in range(5):
                assert all(backend.batch_set(ks, vals))
                assert backend.batch_get(ks) == vals
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(BOUND_S)
    assert not errors
    st = backend.stats()
    assert st["sets"] == st["gets"] == st["hits"] == 4 * 5 * 50


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", ["abc", key(1).upper(), key(1) + ".", key(1) + ".a b",
                                 key(1) + "." + "s" * 33, key(1)[:-1], 123, None, "../" + key(1)])
def test_bad_keys_are_rejected_before_any_io(backend, bad):
    good = key(1)
    with pytest.raises(ValueError, match="not a storage key"):
        backend.batch_set([good, bad], [b"x", b"y"])
    assert backend.batch_get([good]) == [None]   # nothing of the batch was written
    for call in (lambda: backend.batch_exists([good, bad]), lambda: backend.batch_get([bad]),
                 lambda: backend.delete(bad)):
        with pytest.raises(ValueError, match="not a storage key"):
            call()


def test_settings_are_checked(srv):
    with pytest.raises(ValueError, match="url, prefix, socket_timeout") as e:
        RedisBackend(srv.url, host="127.0.0.1")
    assert "host" in str(e.value)
    for kw in ({"socket_timeout": 0}, {"socket_timeout": "2"}, {"socket_timeout": True},
               {"prefix": None}, {"url": ""}, {"url": "http://127.0.0.1:1/"}):
        with pytest.raises(ValueError):
            RedisBackend(**{"url": srv.url, **kw})


def test_made_by_name_from_extra_config(srv, prefix):
    from uniradix.hicache.backends import make_backend
    b = make_backend("redis", f'{{"url": "{srv.url}", "prefix": "{prefix}", "socket_timeout": 1, '
                              f'"prefetch_threshold": 128}}')
    with b:
        assert isinstance(b, RedisBackend) and b.prefix == prefix and b.socket_timeout == 1.0
        assert b.batch_set(keys(1), [b"x"]) == [True]
    with pytest.raises(ValueError, match="url, prefix, socket_timeout"):
        make_backend("redis", {"url": srv.url, "pasword": "typo"})


def test_missing_redis_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match="pip install redis"):
        RedisBackend()


# --------------------------------------------------------------------------- faults
def _assert_unavailable(b: RedisBackend, where: str):
    calls = [lambda: b.batch_exists(keys(2)), lambda: b.batch_get(keys(2)),
             lambda: b.batch_set(keys(2), [b"a", b"b"]), lambda: b.delete(key(0)), b.clear]
    for call in calls:
        t = time.monotonic()
        with pytest.raises(StorageUnavailable, match=where):
            call()
        assert time.monotonic() - t < BOUND_S


def test_server_down_at_start(caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"   # nothing listens there
    with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
        b = RedisBackend(url, socket_timeout=1.0)   # warns, does not fail: the engine goes on
    assert any(url in r.getMessage() for r in caplog.records)
    with b:
        _assert_unavailable(b, url)
        st = b.stats()
        assert st["errors"] == 1 + 5 and st["hits"] == 0
        assert st["sets"] == st["set_failures"] == 2


def test_password_is_not_in_messages():
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    with RedisBackend(url, socket_timeout=1.0) as b:
        with pytest.raises(StorageUnavailable) as e:
            b.batch_get(keys(1))
        assert "s3cret" not in str(e.value) and "***" in str(e.value)
        assert "s3cret" not in repr(b) and "s3cret" not in str(b.stats())


def test_server_killed_mid_run_then_restarted():
    with redis_server() as s:
        b = RedisBackend(s.url, socket_timeout=1.0)
        assert all(b.batch_set(keys(4), [b"a"] * 4))
        s.stop(kill=True)   # SIGKILL: no goodbye on the open connection
        _assert_unavailable(b, s.url)
        assert b.stats()["errors"] == 5
        s.start()           # same port, empty (no persistence)
        with RedisBackend(s.url, socket_timeout=1.0) as fresh:
            assert fresh.batch_exists(keys(4)) == 0
            assert fresh.batch_set(keys(2), [b"x", b"y"]) == [True, True]
            assert fresh.batch_get(keys(2)) == [b"x", b"y"]
        # the old instance reconnects by itself and sees the same store
        assert b.batch_get(keys(2)) == [b"x", b"y"]
        b.close()


def test_out_of_memory_refuses_sets_per_key():
    with redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as s, \
            RedisBackend(s.url) as b:
        rng = random.Random(4)
        values = [rng.randbytes(256 * 1024) for _ in range(16)]
        ok = b.batch_set(keys(16), values)   # no exception
        assert any(ok) and not all(ok)
        st = b.stats()
        assert st["sets"] == 16 and st["set_failures"] == ok.count(False) and st["errors"] == 0
        got = b.batch_get(keys(16))
        assert got == [v if stored else None for v, stored in zip(values, ok)]
        # reads and deletes still work on a full server; freeing room lets sets in again
        for k, stored in zip(keys(16), ok):
            if stored:
                assert b.delete(k)
        assert b.batch_set(keys(1, start=100), [values[0]]) == [True]
        assert b.batch_get(keys(1, start=100)) == [values[0]]


def test_unresponsive_server_times_out():
    with redis_server() as s, RedisBackend(s.url, socket_timeout=0.3) as b:
        assert b.batch_set(keys(1), [b"v"]) == [True]
        assert s.cli("CLIENT", "PAUSE", "2000", "ALL").startswith(b"+OK")  # no replies for 2 s
        t = time.monotonic()
        with pytest.raises(StorageUnavailable, match="timed out") as e:
            b.batch_get(keys(1))
        assert time.monotonic() - t < BOUND_S
        assert s.url in str(e.value)
        assert b.stats()["errors"] == 1
        assert s.cli("PING").startswith(b"+PONG")   # answered once the pause ends
        assert b.batch_get(keys(1)) == [b"v"]       # and the backend works again


def test_closed_backend_is_unavailable(srv, prefix):
    b = RedisBackend(srv.url, prefix=prefix)
    b.close()
    b.close()   # twice is fine
    with pytest.raises(StorageUnavailable, match="closed"):
        b.batch_get(keys(1))


# --------------------------------------------------------------------------- counters
def test_stats_count(backend, srv, prefix):
    st = backend.stats()
    assert {k: st[k] for k in ("gets", "hits", "sets", "set_failures", "errors")} == dict.fromkeys(
        ("gets", "hits", "sets", "set_failures", "errors"), 0)
    assert st["backend"] == "redis" and st["url"] == srv.url and st["prefix"] == prefix
    backend.batch_set(keys(3), [b"ab", b"", b"cdef"])
    backend.batch_get(keys(5))
    backend.batch_exists(keys(5))
    backend.delete(key(0))
    st = backend.stats()
    assert (st["gets"], st["hits"], st["sets"], st["set_failures"], st["errors"]) == (5, 3, 3, 0, 0)
    assert st["bytes_written"] == 6 and st["bytes_read"] == 6
    assert st["exists_calls"] == 1 and st["deletes"] == 1
