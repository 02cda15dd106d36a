"""The Redis L3 backend against a real redis-server on 127.0.0.1 (started and stopped by
the tests, see redis_server.py): settings, batch_contains in one round trip, the server
down at start, killed mid-run, out of memory (counted, warned about once), a foreign
value, and unresponsive. The StorageBackend contract (round trips, exists,
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


# --------------------------------------------------------------------------- round trips
def test_batch_contains_is_one_round_trip(monkeypatch):
    # 2,000 keys (one 2,000-token request at page size 1): one pipeline, one send, and
    # on the server one TOUCH per key and nothing else.
    import redis
    with redis_server() as s, RedisBackend(s.url) as b, redis.Redis.from_url(s.url) as raw:
        ks = keys(2000, ns="rt")
        assert all(b.batch_set(ks[::3], [b"v"] * len(ks[::3])))
        sends = []
        real = redis.connection.AbstractConnection.send_packed_command

        def send(conn, command, *args, **kw):
            sends.append(command)
            return real(conn, command, *args, **kw)

        raw.config_resetstat()
        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send)
        got = b.batch_contains(ks)
        monkeypatch.undo()
        assert got == [i % 3 == 0 for i in range(2000)]
        assert len(sends) == 1
        stats = raw.info("commandstats")
        assert stats["cmdstat_touch"]["calls"] == 2000
        mine = {k for k in stats if not k.startswith(("cmdstat_config", "cmdstat_info"))}
        assert mine == {"cmdstat_touch"}
        assert b.stats()["exists_calls"] == 1


def test_checking_keys_keeps_them_in_an_lru_store():
    """Before: the membership check was EXISTS, which is no use of a key to Redis's LRU:
    under maxmemory-policy allkeys-lru a hot prefix (served from the device, so only
    ever checked by each write, never read) aged and was the first evicted, and a fresh
    server could not resume it. The check is now a use (TOUCH): the colder keys go."""
    with redis_server("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "64") as s, \
            RedisBackend(s.url) as b:
        value = b"v" * 16384
        hot, cold, more = keys(20, ns="hot"), keys(100, ns="cold"), keys(120, ns="more")
        assert all(b.batch_set(hot, [value] * len(hot)))
        time.sleep(1.1)  # Redis's LRU clock ticks once a second
        assert all(b.batch_set(cold, [value] * len(cold)))
        time.sleep(1.1)
        assert b.batch_contains(hot) == [True] * len(hot)   # a write re-checking what it believes stored
        for k in more:  # past maxmemory: Redis evicts the least recently used
            b.batch_set([k], [value])
        assert sum(b.batch_contains(cold)) < len(cold)      # evictions happened...
        assert b.batch_contains(hot) == [True] * len(hot)   # ...and took none of the hot keys


# --------------------------------------------------------------------------- faults
def test_server_down_at_start():
    url = f"redis://127.0.0.1:{free_port()}/0"   # nothing listens there
    b = RedisBackend(url, socket_timeout=1.0)   # builds: whether a start may go on is the probe's to say
    with b:
        with pytest.raises(StorageUnavailable, match=url):
            b.probe()   # what open_backend asks at start-up (one PING)
        calls = assert_unavailable(b, url, BOUND_S)
        st = b.stats()
        assert st["errors"] == 1 + calls and st["hits"] == 0
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
        calls = assert_unavailable(b, s.url, BOUND_S)
        assert b.stats()["errors"] == calls
        s.start()           # same port, empty (no persistence)
        with RedisBackend(s.url, socket_timeout=1.0) as fresh:
            assert fresh.batch_exists(keys(4)) == 0
            assert fresh.batch_set(keys(2), [b"x", b"y"]) == [True, True]
            assert fresh.batch_get(keys(2)) == [b"x", b"y"]
        # the old instance reconnects by itself and sees the same store; the reconnect
        # bumps its generation (the storage tier then believes nothing stored any more)
        assert b.generation == 0
        assert b.batch_get(keys(2)) == [b"x", b"y"]
        assert b.generation == 1
        b.close()


def test_a_restart_between_calls_bumps_the_generation():
    """A restart the client never saw fail (its pooled connection reconnects inside the
    next call) still tells the storage tier that the store may have lost everything;
    more connections for a busier pool do not."""
    import threading
    with redis_server() as s:
        b = RedisBackend(s.url, socket_timeout=1.0)
        threads = [threading.Thread(target=b.batch_get, args=(keys(2),)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert b.generation == 0
        s.restart()
        assert b.batch_exists(keys(1)) == 0 and b.generation >= 1
        g = b.generation
        assert b.batch_exists(keys(1)) == 0 and b.generation == g
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
        assert b.failure_log.pending("failed sets") == 0   # the first refusal: logged in full
        got = b.batch_get(keys(16))
        assert got == [v if stored else None for v, stored in zip(values, ok)]
        # reads and deletes still work on a full server; freeing room lets sets in again
        for k, stored in zip(keys(16), ok):
            if stored:
                assert b.delete(k)
        assert b.batch_set(keys(1, start=100), [values[0]]) == [True]
        assert b.batch_get(keys(1, start=100)) == [values[0]]


def test_refused_sets_are_counted_and_warned_about_once(caplog):
    with redis_server("--maxmemory", "1mb", "--maxmemory-policy", "noeviction") as s, \
            RedisBackend(s.url) as b:
        big = random.Random(5).randbytes(2 << 20)   # over maxmemory: refused, every time
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
            for i in range(50):
                assert b.batch_set(keys(4, start=4 * i, ns="oom"), [big] * 4) == [False] * 4
            msgs = [r.getMessage() for r in caplog.records]
            assert len(msgs) == 1 and "4 of 4 sets refused: OutOfMemoryError" in msgs[0]
            b.close()
        msgs = [r.getMessage() for r in caplog.records]
        assert len(msgs) == 2 and "196 more failed sets" in msgs[1] and s.url in msgs[1]
        st = b.stats()
        assert st["sets"] == st["set_failures"] == 200 and st["errors"] == 0


def test_a_foreign_value_is_a_counted_miss_and_removed(redis_srv, caplog):
    # Someone else's list under our name: GET answers WRONGTYPE. A miss, an error and an
    # unreadable entry in stats(), one warning; the entry is deleted (it would otherwise
    # look present to EXISTS forever, and the key would never be stored), so the next
    # write stores the key.
    import redis
    with RedisBackend(redis_srv.url, prefix="foreign:") as b, \
            redis.Redis.from_url(redis_srv.url) as raw:
        k = keys(3, ns="foreign")
        raw.rpush("foreign:" + k[1], b"x")
        b.batch_set([k[0]], [b"mine"])
        assert b.batch_contains(k) == [True, True, False]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
            assert b.batch_get(k) == [b"mine", None, None]
            assert b.batch_get(k[1:2]) == [None]
        st = b.stats()
        assert st["errors"] == st["bad_replies"] == st["unreadable"] == 1 and st["hits"] == 1
        assert len(caplog.records) == 1 and "WRONGTYPE" in caplog.records[0].getMessage()
        assert b.batch_contains(k) == [True, False, False] and raw.exists("foreign:" + k[1]) == 0
        assert b.batch_set(k[1:2], [b"again"]) == [True] and b.batch_get(k[1:2]) == [b"again"]
        b.clear()


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
