"""The StorageBackend contract on every backend kind (file, redis, mooncake; see
backend_contract.py): byte-exact round trips, zero-length values, order and misses,
leading-run exists, per-key contains, replace, delete, clear by prefix, sharing between instances and
threads, the counters, close, and bad keys. What only one backend does (a server killed
mid-run, maxmemory, leases, settings) is tested in its own file."""
from __future__ import annotations

import random
import threading

import pytest
from backend_contract import BAD_KEYS, KINDS, key, keys, open_store

from uniradix.hicache.storage import StorageUnavailable, check_key


@pytest.fixture(scope="module", params=KINDS)
def store(request):
    s = open_store(request.param, request)
    yield s
    s.close()


@pytest.fixture
def backend(store, request):
    """The test's backend; what the test made is closed, and the store cleaned, after."""
    gap = store.known_gaps.get(request.node.originalname)
    if gap:
        request.applymarker(pytest.mark.xfail(strict=True, reason=gap))
    try:
        yield store.backend()
    finally:
        store.finish()


# --------------------------------------------------------------------------- round trips
def test_round_trip_is_byte_exact(backend):
    rng = random.Random(1)
    values = [b"x", rng.randbytes(1 << 20), b"\x00\r\n$-1\r\n*0\r\n\xff" * 3, bytes(range(256)),
              rng.randbytes((1 << 20) + 7), b"\x00" * 4096, b"\0\1\2"]
    ks = keys(len(values), ns="rt")
    assert backend.batch_set(ks, values) == [True] * len(values)
    got = backend.batch_get(ks)
    assert [type(g) for g in got] == [bytes] * len(values)
    assert got == values


def test_zero_length_values(store, backend):
    ks = keys(3, ns="empty")
    before = backend.stats()
    ok = backend.batch_set(ks, [b"", b"y", bytearray()])
    got = backend.batch_get(ks)
    if store.empty_stored:   # stored, not a miss
        assert ok == [True] * 3
        assert got == [b"", b"y", b""] and [type(g) for g in got] == [bytes] * 3
        assert backend.batch_exists(ks) == 3
    else:                    # refused per key, not an error
        assert ok == [False, True, False]
        assert got == [None, b"y", None]
        assert backend.batch_exists(ks) == 0 and backend.batch_exists(ks[1:2]) == 1
    after = backend.stats()
    assert after["sets"] - before["sets"] == 3
    assert after["set_failures"] - before["set_failures"] == ok.count(False)
    assert after["errors"] == before["errors"]


def test_many_keys_keep_order_and_misses_are_none(store, backend):
    rng = random.Random(2)
    ks = keys(300, ns="many") + keys(300, suffix="swa", ns="many") + keys(100, suffix="mamba_3", ns="many")
    smallest = 0 if store.empty_stored else 1
    values = [rng.randbytes(rng.randrange(smallest, 3000)) for _ in ks]
    assert all(backend.batch_set(ks, values))
    absent = keys(50, start=10_000, ns="many")
    query = [k for pair in zip(ks, absent) for k in pair] + ks[50:]
    want = dict(zip(ks, values))
    assert backend.batch_get(query) == [want.get(k) for k in query]
    assert backend.batch_get([]) == [] and backend.batch_set([], []) == []


def test_bytearray_and_memoryview_values(backend):
    ks = keys(2, ns="bv")
    assert backend.batch_set(ks, [bytearray(b"ab"), memoryview(b"xcdx")[1:3]]) == [True, True]
    assert backend.batch_get(ks) == [b"ab", b"cd"]
    with pytest.raises(TypeError, match="bytes"):
        backend.batch_set(keys(1, ns="bv2"), ["text"])
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        backend.batch_set(keys(2, ns="bv2"), [b"x"])


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


def test_batch_contains_answers_every_key(store, backend):
    ks = keys(12, ns="in")
    assert backend.batch_contains([]) == []
    assert backend.batch_contains(ks) == [False] * 12                # none
    present = {0, 3, 4, 7, 11}
    assert all(backend.batch_set([ks[i] for i in sorted(present)], [b"v"] * len(present)))
    want = [i in present for i in range(12)]
    before = backend.stats()
    got = backend.batch_contains(ks)
    assert got == want and [type(g) for g in got] == [bool] * 12      # absent first, holes
    if "exists_calls" in store.counters:                              # one call, however many keys
        assert backend.stats()["exists_calls"] - before["exists_calls"] == 1
    # order, duplicates and component suffixes: each key answered where it stands
    swa = key(3, suffix="swa", ns="in")
    backend.batch_set([swa], [b"s"])
    query = [ks[4], ks[1], ks[4], swa, key(3, suffix="mamba", ns="in"), ks[0]]
    assert backend.batch_contains(query) == [True, False, True, True, False, True]
    # the leading run of batch_contains is what batch_exists counts
    for q in (ks, ks[3:], ks[7:], query):
        found = backend.batch_contains(q)
        assert backend.batch_exists(q) == (found.index(False) if False in found else len(found))
    backend.delete(ks[3])
    assert backend.batch_contains(ks[2:5]) == [False, False, True]
    assert backend.stats()["errors"] == before["errors"]


def test_a_value_larger_than_its_readers_store_is_an_unreadable_entry(store, backend):
    """Readers that know how large their values are (expect_values_up_to: the storage
    tier's largest object) are never handed a larger one, which none of them wrote (a
    file extended or sparse, a value someone else set): a miss, counted as unreadable,
    and removed, so the key is stored again; values within the bound read as before."""
    b = store.make()   # its own instance: the bound stays with it
    ks = keys(3, ns="bound")
    assert b.batch_set(ks, [b"a" * 100, b"b" * 101, b"c" * 50_000]) == [True] * 3
    b.expect_values_up_to(100)
    b.expect_values_up_to(60)   # several readers: the largest bound holds
    assert b.max_value_bytes == 100
    before = b.stats()
    assert b.batch_get(ks) == [b"a" * 100, None, None]
    st = b.stats()
    assert st["unreadable"] - before.get("unreadable", 0) == 2 and st["errors"] - before["errors"] >= 2
    if store.bounded_reads:   # never more than the bound of any
        assert st["bytes_read"] - before["bytes_read"] <= 3 * 101
    assert b.batch_contains(ks) == [True, False, False]          # removed: the next write stores them
    assert b.batch_set(ks[1:], [b"d" * 100, b"e"]) == [True, True]
    assert b.batch_get(ks) == [b"a" * 100, b"d" * 100, b"e"]
    if store.empty_stored:   # an empty value is still told from a missing key (the reader drops it)
        assert b.batch_set(ks[2:], [b""]) == [True]
        assert b.batch_get(ks[1:] + keys(1, ns="bound-absent")) == [b"d" * 100, b"", None]
    with pytest.raises(ValueError, match="positive"):
        b.expect_values_up_to(0)


def test_batch_contains_many_keys(backend):
    ks = keys(2000, ns="in2k")
    assert all(backend.batch_set(ks[::3], [b"v"] * len(ks[::3])))
    assert backend.batch_contains(ks) == [i % 3 == 0 for i in range(2000)]


# --------------------------------------------------------------------------- set, delete
def test_set_replaces(store, backend):
    k = [key(7, ns="rep")]
    assert backend.batch_set(k, [b"old value, longer"]) == [True]
    assert backend.batch_get(k) == [b"old value, longer"]   # a read (in Mooncake: a lease)
    assert backend.batch_set(k, [b"new"]) == [True]
    assert backend.batch_get(k) == [b"new"]
    # within one batch the last value for a key wins
    k2 = key(8, ns="rep")
    assert backend.batch_set([k2, k[0], k2], [b"first", b"mid", b"last"]) == [True] * 3
    assert backend.batch_get([k2, k[0]]) == [b"last", b"mid"]
    if store.empty_stored:
        assert backend.batch_set(k, [b""]) == [True]
        assert backend.batch_get(k) == [b""]


def test_delete(backend):
    ks = keys(3, ns="del")
    backend.batch_set(ks, [b"a", b"b", b"c"])
    assert backend.batch_get(ks) == [b"a", b"b", b"c"]   # (Mooncake: leases held, delete works)
    assert backend.delete(ks[1]) is True
    assert backend.delete(ks[1]) is False
    assert backend.delete(key(12345, ns="del")) is False
    assert backend.batch_get(ks) == [b"a", None, b"c"]


# --------------------------------------------------------------------------- clear, sharing
def test_clear_removes_only_its_own_prefix(store, backend):
    # The prefix has characters a glob or regex must escape; "<prefix>sub:" starts with
    # it but is another prefix; the lookalike would match an unescaped pattern; and
    # "<prefix>not-a-key" is not a storage key. Those are other writers' objects, put
    # straight into the store; `backend` has another prefix on the same store.
    p, n = store.clear_prefix, store.clear_n
    a = store.make(p)
    mine, mine_x, theirs = keys(n, ns="cl"), keys(5, suffix="x", ns="cl"), keys(20, ns="cl")
    assert all(a.batch_set(mine + mine_x, [b"a"] * (n + 5)))
    assert all(backend.batch_set(theirs, [b"s"] * 20))
    foreign = [q + k for q in (p + "sub:", store.lookalike) for k in theirs] + [p + "not-a-key"]
    store.raw_put(a, foreign, b"f")
    try:
        a.clear()
        assert a.batch_exists(mine) == 0
        assert a.batch_get(mine_x) == [None] * 5
        assert backend.batch_get(theirs) == [b"s"] * 20
        assert store.raw_get(a, foreign) == [b"f"] * len(foreign)
        a.clear()   # clearing nothing is fine
        backend.clear()
        assert backend.batch_exists(theirs) == 0
        assert store.raw_get(a, foreign) == [b"f"] * len(foreign)
    finally:
        store.raw_remove(a, foreign)


def test_two_instances_share_the_store(store, backend):
    e2 = store.twin(backend)
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
        th.join(300)   # a guard against a hang: 1,000 calls on a loaded machine
    assert not any(th.is_alive() for th in threads)
    assert not errors
    st = backend.stats()
    assert st["sets"] - before["sets"] == st["gets"] - before["gets"] == 4 * 5 * 50
    assert st["hits"] - before["hits"] == 4 * 5 * 50


def test_set_if_absent_keeps_the_first_value(store, backend):
    """What a namespace's witness is written with: the first value stays, and of writers
    racing for one key exactly one wins (where the backend can tell, only its call
    answers True); every writer reads the winner back."""
    k = key(9, ns="sia")
    assert backend.set_if_absent(k, b"first") is True
    assert backend.set_if_absent(k, b"second") is (not store.tells_set_if_absent)
    assert backend.batch_get([k]) == [b"first"]
    k2 = key(10, ns="sia")
    barrier, won = threading.Barrier(4), [None] * 4

    def race(i):
        barrier.wait(30)
        won[i] = backend.set_if_absent(k2, f"writer {i}".encode())

    threads = [threading.Thread(target=race, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)   # a guard against a hang only
    (got,) = backend.batch_get([k2])
    assert got in {f"writer {i}".encode() for i in range(4)}
    if store.tells_set_if_absent:
        assert won.count(True) == 1 and won[int(got.split()[1])] is True
    with pytest.raises(ValueError):
        backend.set_if_absent("nope", b"x")


# --------------------------------------------------------------------------- counters, close
def test_counters_then_close(store, backend):
    b = store.make()   # a new backend: its counters start at zero
    assert {k: b.stats()[k] for k in store.counters} == dict.fromkeys(store.counters, 0)
    ks = keys(5, ns="cnt")
    b.batch_set(ks[:3], [b"ab", b"", b"cdef"])
    b.batch_get(ks)
    b.batch_exists(ks)
    b.delete(ks[0])
    st = b.stats()
    empty = 1 if store.empty_stored else 0
    want = {"gets": 5, "hits": 2 + empty, "sets": 3, "set_failures": 1 - empty, "errors": 0,
            "bytes_written": 6, "bytes_read": 6, "exists_calls": 1, "deletes": 1}
    assert {k: st[k] for k in store.counters} == {k: want[k] for k in store.counters}
    ident = store.identity(b)
    assert {k: st[k] for k in ident} == ident
    b.clear()
    b.close()
    b.close()   # twice is fine
    if store.closes:
        for call in (lambda: b.batch_get(keys(1)), lambda: b.batch_exists(keys(1))):
            with pytest.raises(StorageUnavailable, match="closed"):
                call()


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", BAD_KEYS)
def test_bad_keys_are_rejected_before_any_io(backend, bad):
    good = key(1, ns="bad")
    with pytest.raises(ValueError, match="not a storage key"):
        backend.batch_set([good, bad], [b"x", b"y"])
    assert backend.batch_get([good]) == [None]   # nothing of the batch was written
    for call in (lambda: backend.batch_exists([good, bad]), lambda: backend.batch_get([bad]),
                 lambda: backend.batch_contains([good, bad]), lambda: backend.delete(bad)):
        with pytest.raises(ValueError, match="not a storage key"):
            call()
    assert backend.batch_contains([good]) == [False]


def test_check_key_refuses_a_trailing_newline():
    k = key(1)
    assert check_key(k) == k and check_key(k + ".swa") == k + ".swa"
    for bad in (k + "\n", k + ".swa\n", k + "\r\n", "\n" + k):
        with pytest.raises(ValueError, match="not a storage key"):
            check_key(bad)
