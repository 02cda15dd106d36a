"""The Mooncake L3 backend against a real mooncake_master on 127.0.0.1 (started and
stopped by the tests, see mooncake_master.py; clients use P2PHANDSHAKE and tcp): what
only Mooncake does (the local buffer, chunked existence queries, batch_contains in one
query, put vs upsert, objects in lent memory), failures counted and warned about once,
settings, the master down at start and killed mid-run. The
StorageBackend contract (round trips, zero-length values refused, exists, replace,
delete, clear by prefix, sharing, counters, close, bad keys) runs on Mooncake in
test_backend_contract.py.

Closing a Mooncake client takes about a second (its own threads), so most tests share
the session's backend (conftest.py; cleared after each test) and make new ones only
where the test is about separate instances.
"""
from __future__ import annotations

import json
import logging
import random
import sys
import time

import pytest
from backend_contract import MOONCAKE_SIZES as SIZES
from backend_contract import assert_unavailable, key, keys
from mooncake_master import free_port, master_server, require_mooncake

from uniradix.hicache.backends import mooncake as mc
from uniradix.hicache.backends.mooncake import MooncakeBackend, resolve_settings
from uniradix.hicache.storage import StorageUnavailable

BOUND_S = 60.0   # a guard only: every failing call must return well within this (a loaded machine too)


@pytest.fixture
def master(mooncake_srv):
    """The session's master (conftest.py)."""
    return mooncake_srv


@pytest.fixture
def make(master):
    """Backends on the session's master; closed (in order) when the test ends."""
    made = []

    def make_(**cfg):
        b = MooncakeBackend({"master": master.address, **SIZES, **cfg})
        made.append(b)
        return b
    yield make_
    for b in made:
        b.close()


@pytest.fixture
def backend(mooncake_shared):
    """The session's backend (conftest.py), emptied after the test."""
    yield mooncake_shared
    mooncake_shared.clear()


# ------------------------------------------------------------------ what only Mooncake does
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


def test_batch_exists_over_several_queries(backend):
    n = mc.EXISTS_CHUNK + 100
    ks = keys(n, ns="exq")
    assert all(backend.batch_set(ks, [b"v"] * n))
    assert backend.batch_exists(ks) == n
    backend.delete(ks[mc.EXISTS_CHUNK + 50])
    assert backend.batch_exists(ks) == mc.EXISTS_CHUNK + 50
    backend.delete(ks[7])
    assert backend.batch_exists(ks) == 7


class CountingStore:
    """The real store, counting the calls made through it."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        fn = getattr(self.store, name)

        def call(*args):
            self.calls.append(name)
            return fn(*args)
        return call


def test_batch_contains_is_one_existence_query(backend, monkeypatch):
    n = 4 * mc.EXISTS_CHUNK
    ks = keys(n, ns="inq")
    assert all(backend.batch_set(ks[1::2], [b"v"] * (n // 2)))
    counting = CountingStore(backend.client._store)
    monkeypatch.setattr(backend.client, "_store", counting)
    assert backend.batch_contains(ks) == [i % 2 == 1 for i in range(n)]
    assert counting.calls == ["batch_is_exist"]


def test_values_too_large_are_counted_and_warned_about_once(make, caplog):
    b = make(prefix="large:", local_buffer_size="1MB", global_segment_size=0)
    big = bytes(2 << 20)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
        for i in range(20):
            ok = b.batch_set(keys(5, start=5 * i, ns="large"), [big] * 4 + [b"ok"])
            assert ok == [False] * 4 + [True]
        msgs = [r.getMessage() for r in caplog.records]
        assert len(msgs) == 1 and "larger than local_buffer_size" in msgs[0], msgs
        b.clear()
        b.close()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "79 more failed sets" in msgs[1], msgs
    st = b.stats()
    assert st["sets"] == 100 and st["set_failures"] == 80 and st["errors"] == 0


def test_mooncake_put_keeps_the_old_value(backend):
    # Why batch_set uses upsert: a plain put of an existing key answers success and
    # keeps what was there. (If Mooncake changes this, the backend still replaces.)
    name = backend.prefix + key(1, ns="put")
    store = backend.client._store
    assert store.put(name, b"one") == 0
    assert store.put(name, b"two") == 0
    assert store.get(name) == b"one"
    assert store.upsert(name, b"two") == 0
    assert store.get(name) == b"two"


def test_objects_outlive_a_writer_that_lends_no_memory(backend, make):
    # Objects live in the segments clients lend (here the session's backend). A writer
    # with global_segment_size 0 lends none: after it closes, a fresh instance (also
    # lending none) still reads what it wrote: a fresh engine over the same store.
    writer = make(prefix="lend:", global_segment_size=0)
    values = [random.Random(5).randbytes(65536) for _ in range(4)]
    assert all(writer.batch_set(keys(4, ns="lend"), values))
    writer.close()
    reader = make(prefix="lend:", global_segment_size=0)
    assert reader.batch_get(keys(4, ns="lend")) == values
    reader.clear()


# --------------------------------------------------------------------------- settings
def test_settings_defaults_and_sizes():
    s = resolve_settings({"master": "127.0.0.1:5"}, environ={})
    assert s == {"master": "127.0.0.1:5", "te_meta_data_server": "P2PHANDSHAKE", "protocol": "tcp",
                 "device": "", "global_segment_size": 64 << 20, "local_buffer_size": 64 << 20,
                 "local_hostname": "127.0.0.1", "prefix": "uniradix:", "connect_timeout": 2.0,
                 "op_timeout": 10.0}
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
    ({"master": "h:1", "op_timeout": float("inf")}, "op_timeout"),
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
def test_master_down_at_start_then_up():
    require_mooncake()
    port = free_port()
    addr = f"127.0.0.1:{port}"   # nothing listens there
    t = time.monotonic()
    b = MooncakeBackend({"master": addr, **SIZES})   # builds: whether a start may go on is the probe's to say
    assert time.monotonic() - t < BOUND_S
    with b:
        with pytest.raises(StorageUnavailable, match=addr):
            b.probe()   # what open_backend asks at start-up
        calls = assert_unavailable(b, addr, BOUND_S)
        st = b.stats()
        assert st["errors"] == 2 + calls and st["hits"] == 0 and st["connects"] == 0
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


def test_a_call_that_hangs_is_bounded_by_op_timeout(master, monkeypatch):
    """The client has no timeout of its own: a call that never returns (a master that
    accepts and never answers) raises StorageUnavailable after op_timeout; with
    MAX_HUNG calls left hanging the next ones fail at once; close() does not close a
    client a call is still inside, and does not wait for it past op_timeout."""
    require_mooncake()
    import threading
    gate = threading.Event()

    class Stuck:
        closed = 0

        def setup(self, *args):
            return 0

        def batch_is_exist(self, names):
            gate.wait()
            return [0] * len(names)

        def close(self):
            Stuck.closed += 1
            return 0

    monkeypatch.setattr(mc, "_store_class", lambda: Stuck)
    b = MooncakeBackend({"master": master.address, "op_timeout": 0.2})
    try:
        for _ in range(mc.MAX_HUNG):
            with pytest.raises(StorageUnavailable, match="did not answer batch_is_exist within op_timeout"):
                b.batch_exists(keys(1))
        with pytest.raises(StorageUnavailable, match=f"has {mc.MAX_HUNG} calls that did not return"):
            b.batch_contains(keys(2))
        assert b.stats()["errors"] == mc.MAX_HUNG + 1
        b.settings["op_timeout"] = 600.0   # calls given up already are not waited for at all
        closing = threading.Thread(target=b.close, daemon=True)
        closing.start()
        closing.join(60)   # a guard: a close that waits for them fails here, not hangs the run
        assert not closing.is_alive()
        assert Stuck.closed == 0   # calls are still inside it
    finally:
        gate.set()


def test_master_killed_mid_run_then_restarted():
    with master_server() as m:
        b = MooncakeBackend({"master": m.address, "prefix": "kill:", **SIZES})
        try:
            assert all(b.batch_set(keys(4, ns="kill"), [b"a"] * 4))
            m.stop(kill=True)   # SIGKILL: no goodbye
            calls = assert_unavailable(b, m.address, BOUND_S)
            assert b.stats()["errors"] == calls and b.stats()["connected"] is False
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
            assert b.generation >= 1   # the storage tier believes nothing stored from before
        finally:
            b.close()
