"""The Redis L3 backend against a real redis-server on 127.0.0.1 (started and stopped by
the tests, see redis_server.py): settings, the server down at start, killed mid-run,
out of memory, and unresponsive. The StorageBackend contract (round trips, exists,
replace, delete, clear by prefix, sharing, counters, close, bad keys) runs on Redis in
test_backend_contract.py."""
from __future__ import annotations

import logging
import random
import sys
import time

import pytest
from backend_contract import assert_unavailable, keys
from redis_server import free_port, redis_server

pytest.importorskip("redis", reason="pip install redis (in the test extra)")

from uniradix.hicache.backends.redis import RedisBackend
from uniradix.hicache.storage import StorageUnavailable

BOUND_S = 30.0   # a guard only: every failing call must return, well within this


# --------------------------------------------------------------------------- settings
def test_settings_are_checked(redis_srv):
    srv = redis_srv   # the session's server (conftest.py)
    with pytest.raises(ValueError, match="url, prefix, socket_timeout") as e:
        RedisBackend(srv.url, host="127.0.0.1")
    assert "host" in str(e.value)
    for kw in ({"socket_timeout": 0}, {"socket_timeout": "2"}, {"socket_timeout": True},
               {"prefix": None}, {"url": ""}, {"url": "http://127.0.0.1:1/"}):
        with pytest.raises(ValueError):
            RedisBackend(**{"url": srv.url, **kw})


def test_made_by_name_from_extra_config(redis_srv):
    from uniradix.hicache.backends import make_backend
    srv, prefix = redis_srv, "byname:"
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
def test_server_down_at_start(caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"   # nothing listens there
    with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
        b = RedisBackend(url, socket_timeout=1.0)   # warns, does not fail: the engine goes on
    assert any(url in r.getMessage() for r in caplog.records)
    with b:
        assert_unavailable(b, url, BOUND_S)
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
        assert_unavailable(b, s.url, BOUND_S)
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
