"""The Mooncake L3 backend against a real mooncake_master on 127.0.0.1 (started and
stopped by the tests, see mooncake_master.py; clients use P2PHANDSHAKE and tcp):
byte-exact round trips, leading-run exists, replace, delete, clear by prefix, sharing
between instances, bad keys and settings, the master down at start and killed mid-run,
and the counters.

Closing a Mooncake client takes about a second (its own threads), so most tests share
one module-wide backend (cleared after each test) and make new ones only where the
test is about separate instances."""
from __future__ import annotations

import hashlib
import json
import logging
import random
import sys
import threading
import time

import pytest
from mooncake_master import free_port, master_server, require_mooncake

from uniradix.hicache.backends import mooncake as mc
from uniradix.hicache.backends.mooncake import MooncakeBackend, resolve_settings
from uniradix.hicache.storage import StorageUnavailable

BOUND_S = 15.0   # a guard only: every failing call must return well within this
SIZES = {"global_segment_size": "64MB", "local_buffer_size": "16MB"}


def key(i, suffix: str = "", ns: str = "") -> str:
    h = hashlib.sha256(f"{ns}/{i}".encode()).hexdigest()
    return h + (f".{suffix}" if suffix else "")


def keys(n, start=0, suffix="", ns="") -> list[str]:
    return [key(i, suffix, ns) for i in range(start, start + n)]


@pytest.fixture(scope="module")
def master():
    with master_server() as m:
        yield m


@pytest.fixture
def make(master):
    """Backends on the module's master; closed (in order) when the test ends."""
    made = []

    def make_(**cfg):
        b = MooncakeBackend({"master": master.address, **SIZES, **cfg})
        made.append(b)
        return b
    yield make_
    for b in made:
        b.close()


@pytest.fixture(scope="module")
def shared(master):
    b = MooncakeBackend({"master": master.address, "prefix": "shared:", **SIZES})
    yield b
    b.close()


@pytest.fixture
def backend(shared):
    """The module-wide backend, emptied after the test."""
    yield shared
    shared.clear()


# --------------------------------------------------------------------------- round trips
def test_round_trip_is_byte_exact(backend):
    rng = random.Random(1)
    values = [b"x", rng.randbytes(1 << 20), b"\x00\r\n$-1\r\n*0\r\n\xff" * 3, bytes(range(256)),
              rng.randbytes((1 << 20) + 7), b"\x00" * 4096]
    ks = keys(len(values), ns="rt")
    assert backend.batch_set(ks, values) == [True] * len(values)
    got = backend.batch_get(ks)
    assert [type(g) for g in got] == [bytes] * len(values)
    assert got == values


def test_empty_values_are_refused_not_stored(backend):
    # Mooncake cannot hold a zero-length object; the L3 objects above never are empty.
    ks = keys(3, ns="empty")
    before = backend.stats()
    assert backend.batch_set(ks, [b"", b"y", bytearray()]) == [False, True, False]
    assert backend.batch_get(ks) == [None, b"y", None]
    after = backend.stats()
    assert after["sets"] - before["sets"] == 3
    assert after["set_failures"] - before["set_failures"] == 2
    assert after["errors"] == before["errors"]


def test_many_keys_keep_order_and_misses_are_none(backend):
    rng = random.Random(2)
    ks = keys(300, ns="many") + keys(300, suffix="swa", ns="many") + keys(100, suffix="mamba_3", ns="many")
    values = [rng.randbytes(rng.randrange(1, 3000)) for _ in ks]
    assert all(backend.batch_set(ks, values))
    absent = keys(50, start=10_000, ns="many")
    query = [k for pair in zip(ks, absent) for k in pair] + ks[50:]
    want = dict(zip(ks, values))
    assert backend.batch_get(query) == [want.get(k) for k in query]
    assert backend.batch_get([]) == [] and backend.batch_set([], []) == []


def test_batches_larger_than_the_local_buffer(make):
    # Every value passes through the client's local buffer (here 4 MiB): sets are cut
    # into batches that fit, gets fetch again what did not fit, a value larger than the
    # buffer is refused.
    b = make(prefix="small:", local_buffer_size="4MB")
    rng = random.Random(3)
    values = [rng.randbytes(1 << 20) for _ in range(12)]
    ks = keys(12, ns="big")
    assert b.batch_set(ks, values) == [True] * 12
    assert b.batch_exists(ks) == 12
    assert b.batch_get(ks) == values
    k = keys(1, ns="too-big")
    assert b.batch_set(k, [rng.randbytes(5 << 20)]) == [False]
    assert b.batch_get(k) == [None]
    assert b.stats()["errors"] == 0
    b.clear()


def test_bytearray_and_memoryview_values(backend):
    ks = keys(2, ns="bv")
    assert backend.batch_set(ks, [bytearray(b"ab"), memoryview(b"xcdx")[1:3]]) == [True, True]
    assert backend.batch_get(ks) == [b"ab", b"cd"]
    with pytest.raises(TypeError, match="bytes"):
        backend.batch_set(keys(1), ["text"])
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        backend.batch_set(keys(2), [b"x"])


# --------------------------------------------------------------------------- exists
def test_batch_exists_is_the_leading_run(backend):
    ks = keys(10, ns="ex")
    assert backend.batch_exists(ks) == 0                       # none
    assert backend.batch_exists([]) == 0
    backend.batch_set(ks, [b"v"] * 10)
    assert backend.batch_exists(ks) == 10                      # all
    backend.delete(ks[4])
    assert backend.batch_exists(ks) == 4                       # absent in the middle
    assert backend.batch_exists(ks[5:]) == 5                   # the rest is there
    assert backend.batch_exists([key(999, ns="ex")] + ks[:3]) == 0      # first absent
    assert backend.batch_exists(ks[:3] + [key(999, ns="ex")] + ks[5:]) == 3


def test_batch_exists_over_several_queries(backend):
    n = mc.EXISTS_CHUNK + 100
    ks = keys(n, ns="exq")
    assert all(backend.batch_set(ks, [b"v"] * n))
    assert backend.batch_exists(ks) == n
    backend.delete(ks[mc.EXISTS_CHUNK + 50])
    assert backend.batch_exists(ks) == mc.EXISTS_CHUNK + 50
    backend.delete(ks[7])
    assert backend.batch_exists(ks) == 7


# --------------------------------------------------------------------------- set, delete
def test_set_replaces(backend):
    k = [key(7, ns="rep")]
    assert backend.batch_set(k, [b"old value, longer"]) == [True]
    assert backend.batch_get(k) == [b"old value, longer"]   # a read takes a lease
    assert backend.batch_set(k, [b"new"]) == [True]
    assert backend.batch_get(k) == [b"new"]
    # within one batch the last value for a key wins (Mooncake's own batch keeps the first)
    k2 = key(8, ns="rep")
    assert backend.batch_set([k2, k[0], k2], [b"first", b"mid", b"last"]) == [True] * 3
    assert backend.batch_get([k2, k[0]]) == [b"last", b"mid"]


def test_mooncake_put_keeps_the_old_value(backend):
    # Why batch_set uses upsert: a plain put of an existing key answers success and
    # keeps what was there. (If Mooncake changes this, the backend still replaces.)
    name = backend.prefix + key(1, ns="put")
    store = backend._store
    assert store.put(name, b"one") == 0
    assert store.put(name, b"two") == 0
    assert store.get(name) == b"one"
    assert store.upsert(name, b"two") == 0
    assert store.get(name) == b"two"


def test_delete(backend):
    ks = keys(3, ns="del")
    backend.batch_set(ks, [b"a", b"b", b"c"])
    assert backend.batch_get(ks) == [b"a", b"b", b"c"]   # leases held: delete still works
    assert backend.delete(ks[1]) is True
    assert backend.delete(ks[1]) is False
    assert backend.delete(key(12345, ns="del")) is False
    assert backend.batch_get(ks) == [b"a", None, b"c"]


# --------------------------------------------------------------------------- clear, sharing
def test_clear_removes_only_its_own_prefix(backend, make):
    # "c1." has a regex character; "c1.sub:" starts with it but is another prefix; "c1x"
    # would match an unescaped "c1."; "c1.not-a-key" is not a storage key.
    a = make(prefix="c1.")
    raw = a._store   # other writers' objects, put straight into the store
    n = 300
    assert all(a.batch_set(keys(n, ns="cl") + keys(5, suffix="x", ns="cl"), [b"a"] * (n + 5)))
    assert all(backend.batch_set(keys(20, ns="cl"), [b"s"] * 20))
    foreign = [p + k for p in ("c1.sub:", "c1x") for k in keys(20, ns="cl")] + ["c1.not-a-key"]
    assert raw.upsert_batch(foreign, [b"f"] * len(foreign)) == 0
    a.clear()
    assert a.batch_exists(keys(n, ns="cl")) == 0
    assert a.batch_get(keys(5, suffix="x", ns="cl")) == [None] * 5
    assert backend.batch_get(keys(20, ns="cl")) == [b"s"] * 20
    assert raw.batch_is_exist(foreign) == [1] * len(foreign)
    a.clear()   # clearing nothing is fine
    assert raw.batch_remove(foreign, True) == [0] * len(foreign)


def test_two_instances_share_the_store(backend, make):
    e2 = make(prefix=backend.prefix)
    rng = random.Random(3)
    values = [rng.randbytes(4096) for _ in range(8)] + [rng.randbytes(1 << 20)]
    ks = keys(9, ns="share")
    assert all(backend.batch_set(ks, values))
    assert e2.batch_exists(ks) == 9
    assert e2.batch_get(ks) == values
    assert e2.batch_set(ks[:1], [b"from e2"]) == [True]
    assert backend.batch_get(ks[:1]) == [b"from e2"]
    assert e2.delete(ks[0])
    assert backend.batch_exists(ks) == 0 and backend.batch_exists(ks[1:]) == 8
    e2.clear()
    assert backend.batch_get(ks) == [None] * 9


def test_objects_outlive_a_writer_that_lends_no_memory(backend, make):
    # Objects live in the segments clients lend (here the module's backend). A writer
    # with global_segment_size 0 lends none: after it closes, a fresh instance (also
    # lending none) still reads what it wrote: a fresh engine over the same store.
    writer = make(prefix="lend:", global_segment_size=0)
    values = [random.Random(5).randbytes(65536) for _ in range(4)]
    assert all(writer.batch_set(keys(4, ns="lend"), values))
    writer.close()
    reader = make(prefix="lend:", global_segment_size=0)
    assert reader.batch_get(keys(4, ns="lend")) == values
    reader.clear()


def test_threads_share_one_backend(backend):
    errors = []
    before = backend.stats()

    def work(t):
        try:
            ks = keys(50, start=1000 * t, ns="thr")
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
        th.join(60)
    assert not errors
    st = backend.stats()
    assert st["sets"] - before["sets"] == st["gets"] - before["gets"] == 4 * 5 * 50
    assert st["hits"] - before["hits"] == 4 * 5 * 50


def test_counters(make):
    b = make(prefix="cnt:")
    ks = keys(4, ns="cnt")
    b.batch_set(ks[:3], [b"a", b"bb", b""])
    b.batch_get(ks)
    b.batch_exists(ks)
    b.delete(ks[0])
    st = b.stats()
    assert {k: st[k] for k in ("gets", "hits", "sets", "set_failures", "errors", "bytes_written",
                               "bytes_read", "exists_calls", "deletes", "connects")} == \
        {"gets": 4, "hits": 2, "sets": 3, "set_failures": 1, "errors": 0, "bytes_written": 3,
         "bytes_read": 3, "exists_calls": 1, "deletes": 1, "connects": 1}
    assert st["backend"] == "mooncake" and st["master"] == b.master and st["prefix"] == "cnt:"
    assert st["connected"] is True
    b.clear()
    b.close()
    b.close()   # twice is fine
    with pytest.raises(StorageUnavailable, match="closed"):
        b.batch_exists(keys(1))


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", ["abc", key(1).upper(), key(1) + ".", key(1) + ".a b",
                                 key(1) + "." + "s" * 33, key(1)[:-1], 123, None, "../" + key(1)])
def test_bad_keys_are_rejected_before_any_io(backend, bad):
    good = key(1, ns="bad")
    with pytest.raises(ValueError, match="not a storage key"):
        backend.batch_set([good, bad], [b"x", b"y"])
    assert backend.batch_get([good]) == [None]   # nothing of the batch was written
    for call in (lambda: backend.batch_exists([good, bad]), lambda: backend.batch_get([bad]),
                 lambda: backend.delete(bad)):
        with pytest.raises(ValueError, match="not a storage key"):
            call()


def test_settings_defaults_and_sizes():
    s = resolve_settings({"master": "127.0.0.1:5"}, environ={})
    assert s == {"master": "127.0.0.1:5", "te_meta_data_server": "P2PHANDSHAKE", "protocol": "tcp",
                 "device": "", "global_segment_size": 64 << 20, "local_buffer_size": 64 << 20,
                 "local_hostname": "127.0.0.1", "prefix": "uniradix:", "connect_timeout": 2.0}
    for given, want in (("1048576", 1 << 20), ("64MB", 64 << 20), ("4 GiB", 4 << 30),
                        ("2gb", 2 << 30), ("512k", 512 << 10), (0, 0), ("1.5MB", 3 << 19)):
        assert resolve_settings({"master": "h:1", "global_segment_size": given},
                                environ={})["global_segment_size"] == want


def test_settings_come_from_env_and_config_wins():
    env = {"MOONCAKE_MASTER": "10.0.0.1:50051", "MOONCAKE_PROTOCOL": "rdma",
           "MOONCAKE_DEVICE": "mlx5_0", "MOONCAKE_TE_META_DATA_SERVER": "http://10.0.0.1:8080/metadata",
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": "4GB", "MOONCAKE_LOCAL_BUFFER_SIZE": "1073741824",
           "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.2", "OTHER": "x"}
    s = resolve_settings(None, environ=env)
    assert (s["master"], s["protocol"], s["device"], s["te_meta_data_server"],
            s["global_segment_size"], s["local_buffer_size"], s["local_hostname"]) == \
        ("10.0.0.1:50051", "rdma", "mlx5_0", "http://10.0.0.1:8080/metadata", 4 << 30, 1 << 30,
         "10.0.0.2")
    s = resolve_settings({"master": "127.0.0.1:9", "MOONCAKE_PROTOCOL": "tcp", "device_name": "",
                          "metadata_server": "P2PHANDSHAKE", "local_buffer_size": 1 << 20}, environ=env)
    assert (s["master"], s["protocol"], s["device"], s["te_meta_data_server"],
            s["local_buffer_size"], s["global_segment_size"]) == \
        ("127.0.0.1:9", "tcp", "", "P2PHANDSHAKE", 1 << 20, 4 << 30)
    assert resolve_settings(None, environ={**env, "MOONCAKE_DEVICE": ""})["device"] == ""


@pytest.mark.parametrize("cfg, match", [
    ({"master": "h:1", "host": "x"}, r"unknown setting\(s\) \['host'\].*master"),
    ({}, "no master address.*MOONCAKE_MASTER"),
    ({"master": ""}, "no master address"),
    ({"master": "127.0.0.1"}, "host:port"),
    ({"master": "127.0.0.1:0"}, "host:port"),
    ({"master": "127.0.0.1:x"}, "host:port"),
    ({"master": 50051}, "must be a string"),
    ({"master": "h:1", "global_segment_size": "lots"}, "size"),
    ({"master": "h:1", "global_segment_size": -1}, "negative"),
    ({"master": "h:1", "local_buffer_size": 0}, "at least"),
    ({"master": "h:1", "local_buffer_size": True}, "size"),
    ({"master": "h:1", "prefix": "a b"}, "prefix"),
    ({"master": "h:1", "prefix": None}, "prefix"),
    ({"master": "h:1", "connect_timeout": 0}, "connect_timeout"),
    ({"master": "h:1", "protocol": ""}, "protocol"),
    ({"master": "h:1", "MOONCAKE_MASTER": "h:2"}, "given twice"),
])
def test_bad_settings_are_value_errors(cfg, match):
    with pytest.raises(ValueError, match=match):
        resolve_settings(cfg, environ={})


def test_backend_from_env_variables(master, monkeypatch):
    require_mooncake()
    for name, value in (("MOONCAKE_MASTER", master.address), ("MOONCAKE_PROTOCOL", "tcp"),
                        ("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"), ("MOONCAKE_DEVICE", ""),
                        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "16MB"),
                        ("MOONCAKE_LOCAL_BUFFER_SIZE", str(8 << 20)),
                        ("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    with MooncakeBackend() as b:
        assert b.master == master.address and b.settings["local_buffer_size"] == 8 << 20
        assert b.batch_set(keys(1, ns="env"), [b"env"]) == [True]
        assert b.batch_get(keys(1, ns="env")) == [b"env"]
        b.clear()
    monkeypatch.delenv("MOONCAKE_MASTER")
    with pytest.raises(ValueError, match="no master address"):
        MooncakeBackend()


def test_made_by_name_from_extra_config(master, monkeypatch):
    from uniradix.hicache.backends import make_backend
    monkeypatch.setenv("MOONCAKE_MASTER", f"127.0.0.1:{free_port()}")   # overridden below
    extra = {"master": master.address, "prefix": "byname:", "global_segment_size": "16MB",
             "local_buffer_size": "8MB", "prefetch_threshold": 128}
    with make_backend("mooncake", json.dumps(extra)) as b:
        assert isinstance(b, MooncakeBackend) and b.prefix == "byname:"
        assert b.master == master.address
        assert b.batch_set(keys(1, ns="byname"), [b"x"]) == [True]
        b.clear()
    with pytest.raises(ValueError, match="unknown setting"):
        make_backend("mooncake", {"master": master.address, "mastr": "typo"})


def test_missing_mooncake_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ImportError, match="pip install mooncake-transfer-engine-non-cuda"):
        MooncakeBackend({"master": "127.0.0.1:1"})


# --------------------------------------------------------------------------- faults
def _assert_unavailable(b: MooncakeBackend, where: str):
    calls = [lambda: b.batch_exists(keys(2)), lambda: b.batch_get(keys(2)),
             lambda: b.batch_set(keys(2), [b"a", b"b"]), lambda: b.delete(key(0)), b.clear]
    for call in calls:
        t = time.monotonic()
        with pytest.raises(StorageUnavailable, match=where):
            call()
        assert time.monotonic() - t < BOUND_S


def test_master_down_at_start_then_up(caplog):
    require_mooncake()
    port = free_port()
    addr = f"127.0.0.1:{port}"   # nothing listens there
    t = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
        b = MooncakeBackend({"master": addr, **SIZES})   # warns, does not fail: the engine goes on
    assert time.monotonic() - t < BOUND_S
    assert any(addr in r.getMessage() for r in caplog.records)
    with b:
        _assert_unavailable(b, addr)
        st = b.stats()
        assert st["errors"] == 1 + 5 and st["hits"] == 0 and st["connects"] == 0
        assert st["sets"] == st["set_failures"] == 2 and st["connected"] is False
        with master_server(port=port):   # the master comes up: the next call connects
            assert b.batch_set(keys(2, ns="late"), [b"a", b"b"]) == [True, True]
            assert b.batch_get(keys(2, ns="late")) == [b"a", b"b"]
            assert b.stats()["connects"] == 1
            b.close()


def test_setup_refused_is_unavailable(master, monkeypatch):
    require_mooncake()

    class Refusing:
        closed = 0

        def setup(self, *args):
            return -1

        def close(self):
            Refusing.closed += 1
            return 0

    monkeypatch.setattr(mc, "_store_class", lambda: Refusing)
    b = MooncakeBackend({"master": master.address})
    with pytest.raises(StorageUnavailable, match=f"{master.address} refused the client setup"):
        b.batch_exists(keys(1))
    assert Refusing.closed == 2 and b.stats()["errors"] == 2
    b.close()


def test_master_killed_mid_run_then_restarted():
    with master_server() as m:
        b = MooncakeBackend({"master": m.address, "prefix": "kill:", **SIZES})
        try:
            assert all(b.batch_set(keys(4, ns="kill"), [b"a"] * 4))
            m.stop(kill=True)   # SIGKILL: no goodbye
            _assert_unavailable(b, m.address)
            assert b.stats()["errors"] == 5 and b.stats()["connected"] is False
            m.start()           # same port, empty (a new master knows no objects)
            deadline = time.monotonic() + BOUND_S
            while True:         # the client re-registers its segment with the new master
                try:
                    if b.batch_set(keys(2, ns="kill2"), [b"x", b"y"]) == [True, True]:
                        break
                except StorageUnavailable:
                    pass
                assert time.monotonic() < deadline, "no recovery after the master restarted"
                time.sleep(0.2)
            assert b.batch_exists(keys(4, ns="kill")) == 0
            assert b.batch_get(keys(2, ns="kill2")) == [b"x", b"y"]
        finally:
            b.close()
