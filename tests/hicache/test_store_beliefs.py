"""What the writer believes is stored is a cache of the store, not the truth (design.md §4).

A store can lose objects behind the engine's back: Redis FLUSHDB or a restart without
persistence, LRU eviction in a full Redis, files removed. The engine must not skip
those keys forever: the keys a write leaves out as known are re-checked in its one
membership call, a read that finds fewer objects than believed, a failed call and a
backend that reconnected forget them, and a belief expires. Then the same engine writes
the lost prefix again, and a fresh engine on the store reuses it."""
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
from engine_checks import check_exact, greedy  # noqa: E402

from uniradix.engine import Engine  # noqa: E402
from uniradix.hicache import StorageUnavailable  # noqa: E402
from uniradix.hicache.backends.file import FileBackend  # noqa: E402
from uniradix.tree.component import page_floor  # noqa: E402

P = 4


def engine(store, name="tiny-hybrid", threshold=1):
    return Engine(name, page_size=P, max_total_tokens=2048, storage=store, prefetch_threshold=threshold)


def turn(eng, ids, rng, out=4, new=9):
    """One turn of a conversation (checked against the oracle); the next turn's prompt."""
    r = greedy(ids, out)
    eng.run([r])
    check_exact(eng, r)
    return r, r.input_ids + r.output_ids + [rng.randrange(256) for _ in range(new)]


def objects(path) -> list:
    return sorted(f for f in os.listdir(path) if not f.startswith(".") and not f.endswith(".witness"))


def remove_all(path) -> None:
    for f in objects(path):
        os.remove(os.path.join(path, f))


def remove_some(path) -> None:
    """Every other object, the first pages' among them (an LRU or a cleaner would not
    spare them)."""
    for f in objects(path)[::2]:
        os.remove(os.path.join(path, f))


def loses_then_recovers(make_store, lose, name="tiny-hybrid", reads=False):
    """Engine A writes a conversation through, the store loses objects, A goes on
    serving it for two more turns from its own device, and a fresh engine B on the
    store resumes the next turn from L3, as deep as A computed. `reads`: A looks each
    prompt's tail up in the store (the read misses tell it); else it never reads, and
    its writes' re-check must find what is gone."""
    rng = random.Random(61)
    a = engine(make_store(), name, threshold=1 if reads else 100_000)
    ids = [rng.randrange(256) for _ in range(40)]
    for _ in range(2):
        _, ids = turn(a, ids, rng)
    assert a.stats()["storage_saved_objects"] > 0
    lose()
    for _ in range(2):
        last, ids = turn(a, ids, rng)
        assert last.metrics.cached_tokens > 0 and last.metrics.storage_tokens == 0  # served from the device
    s = a.stats()
    a.close()
    b = engine(make_store(), name)
    r = greedy(ids, 3)
    b.run([r])
    check_exact(b, r)
    done = len(last.input_ids) + len(last.output_ids) - 1  # what A computed
    assert r.metrics.storage_tokens == r.metrics.cached_tokens == page_floor(done, P), r.metrics
    b.close()
    if not reads:
        assert s["storage_loads"] == 0
        assert s["storage_lost_objects"] > 0, s["storage"]  # the re-check found what the store lost


@pytest.mark.parametrize("lose", [remove_all, remove_some], ids=["all-files", "some-files"])
@pytest.mark.parametrize("name,reads", [("tiny-hybrid", False), ("full-only", False), ("tiny-hybrid", True)])
def test_files_removed_from_the_store_are_written_again(tmp_path, name, reads, lose):
    loses_then_recovers(lambda: FileBackend(str(tmp_path)), lambda: lose(tmp_path), name, reads)


@pytest.mark.parametrize("how", ["flushdb", "restart"])
def test_a_redis_that_lost_everything_gets_it_written_again(how):
    """FLUSHDB, or a restart without persistence (the client reconnects on its own)."""
    from redis_server import redis_server

    from uniradix.hicache.backends.redis import RedisBackend
    with redis_server() as srv:
        stores = []

        def make():
            stores.append(RedisBackend(srv.url, prefix="beliefs:"))
            return stores[-1]

        def lose():
            if how == "flushdb":
                assert srv.cli("FLUSHDB").startswith(b"+OK")
            else:
                srv.restart()
        try:
            loses_then_recovers(make, lose)
        finally:
            for s in stores:
                s.close()


def test_a_store_found_emptied_gets_its_witness_back(tmp_path):
    """A write that finds objects believed stored gone (the store was emptied, its
    witness with them) has the witness read again before the next call, rather than up
    to RECHECK_S later: the namespace says whose it is before more is written into it."""
    rng = random.Random(62)
    a = engine(FileBackend(str(tmp_path)), threshold=100_000)
    ids = [rng.randrange(256) for _ in range(40)]
    _, ids = turn(a, ids, rng)
    witness = tmp_path / a.storage.witness.key
    assert witness.exists()
    for f in os.listdir(tmp_path):   # everything, the witness too
        os.remove(tmp_path / f)
    for _ in range(2):   # the first write finds the loss, the second asks for the witness first
        _, ids = turn(a, ids, rng)
    assert a.stats()["storage_lost_objects"] > 0
    assert witness.exists() and a.storage.witness.state == "trusted"
    a.close()


def test_a_redis_restart_puts_the_witness_back_at_the_next_call():
    """The client reconnects inside its next call, without an error: its generation
    changes, so the engine believes nothing stored and checks the witness at once (not
    up to RECHECK_S later): the namespace says whose it is again before the engine writes
    into it."""
    from redis_server import redis_server

    from uniradix.hicache.backends.redis import RedisBackend
    with redis_server() as srv:
        backend = RedisBackend(srv.url, prefix="gen:")
        eng = Engine("tiny-hybrid", page_size=P, max_total_tokens=1024, storage=backend, prefetch_threshold=1)
        try:
            r = greedy(list(range(3, 50)), 3)
            eng.run([r])
            name = "gen:" + eng.storage.witness.key
            assert srv.cli("EXISTS", name) == b":1\r\n"
            srv.restart()          # empty: no persistence
            r2 = greedy(list(range(3, 50)) + [7, 7], 3)
            eng.run([r2])
            check_exact(eng, r2)
            assert srv.cli("EXISTS", name) == b":1\r\n"
            assert eng.storage.witness.state == "trusted"
        finally:
            eng.close()
            backend.close()


# --------------------------------------------------------------------------- the store's beliefs
def stored(tmp_path, store_cls=FileBackend, **kw):
    """An engine that served one request, and an L3Store over its cache (nothing
    believed yet) that wrote it through: (engine, store, the cached sequence)."""
    from uniradix.hicache.store import L3Store
    eng = Engine("tiny-hybrid", page_size=P, max_total_tokens=1024)
    rng = random.Random(5)
    r = greedy([rng.randrange(256) for _ in range(45)], 6)
    eng.run([r])
    seq = r.input_ids + r.output_ids[:-1]
    from uniradix.hicache import StorageNamespace
    store = L3Store(eng.cache, store_cls(str(tmp_path)), StorageNamespace.for_model(eng.cfg, P), **kw)
    assert store.save_cached(seq) > 0
    return eng, store, seq


def rereads(store, seq) -> bool:
    """Whether the next write of seq reads objects from the pools again (rather than
    skipping them as believed stored); the write is committed."""
    job = store.prepare_cached(seq)
    store.commit(job)
    return job is not None and bool(job.keys)


def test_a_write_rechecks_what_it_skips_and_forgets_what_is_missing(tmp_path):
    eng, store, seq = stored(tmp_path)
    assert not rereads(store, seq)
    remove_some(tmp_path)
    assert store.save_cached(seq) == 0  # everything believed: nothing read, only re-checked
    assert store.save_cached(seq) > 0  # the next write of the path sends what was lost
    assert store.hit(seq) == page_floor(len(seq), P)
    assert store.counters["lost"] > 0


def test_a_read_that_finds_less_forgets_it(tmp_path):
    eng, store, seq = stored(tmp_path)
    remove_all(tmp_path)
    assert store.hit(seq) == 0
    assert store.save_cached(seq) > 0 and store.hit(seq) == page_floor(len(seq), P)


def test_a_load_that_misses_an_object_forgets_it(tmp_path):
    """The hit still sees every key, but an object is gone when the load reads it."""
    eng, store, seq = stored(tmp_path)
    b = store.hit(seq)
    cache, pools = eng.cache, eng.pools
    pages = {c.name: pools[c.name].alloc(b // P) for c in cache.page_comps}
    slot = pools[cache.ckpt.name].alloc(1)[0]
    os.remove(tmp_path / objects(tmp_path)[0])
    assert store.fetch(seq, b, pages, slot) is None
    assert store.save_cached(seq) > 0 and store.hit(seq) == b
    for c in cache.page_comps:
        pools[c.name].free(pages[c.name])
    pools[cache.ckpt.name].free([slot])


class Flaky(FileBackend):
    """Fails one call with StorageUnavailable when told to."""

    fail = False

    def batch_exists(self, keys):
        if self.fail:
            self.fail = False
            raise StorageUnavailable("connection reset")
        return super().batch_exists(keys)


def test_a_failed_read_forgets_everything(tmp_path):
    eng, store, seq = stored(tmp_path, Flaky)
    store.backend.fail = True
    with pytest.raises(StorageUnavailable):
        store.hit(seq)
    assert rereads(store, seq)
    assert not rereads(store, seq)  # found present again: believed again


def test_a_backend_that_reconnected_forgets_everything(tmp_path):
    """A backend may count its reconnections in `generation`: a new one means the store
    may have restarted."""
    eng, store, seq = stored(tmp_path)
    store.backend.generation = 1
    assert rereads(store, seq)
    assert not rereads(store, seq)


def test_beliefs_expire(tmp_path, monkeypatch):
    import uniradix.hicache.store as store_mod
    eng, store, seq = stored(tmp_path, known_ttl=60.0)
    assert not rereads(store, seq)
    now = store_mod.time.monotonic()
    monkeypatch.setattr(store_mod, "time", SimpleNamespace(monotonic=lambda: now + 61.0))
    assert rereads(store, seq)
