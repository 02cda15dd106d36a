"""Engines over one L3 store: what one wrote, a fresh one reuses, exactly; a store that
fails, lies or fills up costs reuse, never a request or its correctness."""
import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
from engine_checks import check_exact, check_flush, check_ownership, check_work, greedy  # noqa: E402

from uniradix.engine import Engine  # noqa: E402
from uniradix.hicache import StorageBackend, StorageUnavailable  # noqa: E402
from uniradix.hicache.backends.file import FileBackend  # noqa: E402
from uniradix.tree.component import page_floor  # noqa: E402


def engine(name, page, store, threshold=1, **kw):
    return Engine(name, page_size=page, max_total_tokens=2048, storage=store,
                  prefetch_threshold=threshold, **kw)


def conversation(eng, rng, turns=2, first=40, new=9, out=5):
    """Turns of one conversation; returns the requests."""
    ids, reqs = [rng.randrange(256) for _ in range(first)], []
    for _ in range(turns):
        r = greedy(ids, out)
        eng.run([r])
        check_exact(eng, r)
        reqs.append(r)
        ids = r.input_ids + r.output_ids + [rng.randrange(256) for _ in range(new)]
    return reqs, ids


@pytest.mark.parametrize("name", ["tiny-hybrid", "qwen3-next-like", "gpt-oss-like", "gemma3-like",
                                  "jamba-like", "full-only"])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_a_fresh_engine_reuses_what_another_wrote(tmp_path, name, page):
    a = engine(name, page, FileBackend(str(tmp_path)))
    reqs, nxt = conversation(a, random.Random(1))
    assert a.stats()["storage_saved_objects"] > 0
    b = engine(name, page, FileBackend(str(tmp_path)))  # nothing on its device
    r = greedy(nxt, 5)
    b.run([r])
    check_exact(b, r)
    check_work(r)
    last = reqs[-1]
    done = len(last.input_ids) + len(last.output_ids) - 1  # what engine a computed
    assert r.metrics.cached_tokens == r.metrics.storage_tokens == page_floor(done, page)
    check_ownership(b)
    # b's own tree now holds it: the same prompt again is a device hit
    again = greedy(nxt, 2)
    b.run([again])
    check_exact(b, again)
    assert again.metrics.storage_tokens == 0 and again.metrics.cached_tokens >= r.metrics.cached_tokens
    check_flush(b)


def test_below_the_threshold_the_store_is_not_read(tmp_path):
    a = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)))
    _, nxt = conversation(a, random.Random(2), turns=1)
    b = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)), threshold=1000)
    r = greedy(nxt, 3)
    b.run([r])
    check_exact(b, r)
    assert r.metrics.cached_tokens == 0 and b.stats()["storage_loads"] == 0


def test_salts_and_models_do_not_share(tmp_path):
    a = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)))
    _, nxt = conversation(a, random.Random(3), turns=1)
    b = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)))
    r = greedy(nxt, 2)
    r.salt = "tenant-2"
    b.run([r])
    assert r.metrics.cached_tokens == 0
    same = greedy(nxt, 2)
    b.run([same])
    assert same.metrics.storage_tokens > 0  # without the salt it is there
    d = Engine(a.cfg.with_(seed=7), page_size=4, max_total_tokens=2048,
               storage=FileBackend(str(tmp_path)), prefetch_threshold=1)
    r2 = greedy(nxt, 2)
    d.run([r2])
    check_exact(d, r2)
    assert r2.metrics.cached_tokens == 0  # other weights, other namespace


class Down(StorageBackend):
    """A store that is unreachable: every call fails."""

    def _fail(self, *a):
        raise StorageUnavailable("down")

    batch_exists = batch_get = batch_set = delete = clear = _fail


def test_a_store_that_is_down_costs_only_reuse():
    eng = engine("tiny-hybrid", 4, Down())
    reqs, _ = conversation(eng, random.Random(4), turns=3)
    s = eng.stats()
    assert s["storage_errors"] > 0 and s["finished"] == 3
    assert reqs[-1].metrics.cached_tokens > 0  # the device cache still works
    check_flush(eng)


class GoesDown(FileBackend):
    """Works, then fails mid-run."""

    broken = False

    def batch_get(self, keys):
        if self.broken:
            raise StorageUnavailable("gone")
        return super().batch_get(keys)

    def batch_exists(self, keys):
        if self.broken:
            raise StorageUnavailable("gone")
        return super().batch_exists(keys)


def test_a_store_that_fails_mid_run(tmp_path):
    a = engine("jamba-like", 4, FileBackend(str(tmp_path)))
    _, nxt = conversation(a, random.Random(5), turns=1)
    store = GoesDown(str(tmp_path))
    store.broken = True
    b = engine("jamba-like", 4, store)
    r = greedy(nxt, 3)
    b.run([r])
    check_exact(b, r)
    assert r.metrics.cached_tokens == 0 and b.stats()["storage_errors"] >= 1
    store.broken = False
    r2 = greedy(nxt + [1, 2, 3, 4, 5], 3)
    b.run([r2])
    check_exact(b, r2)
    assert r2.metrics.cached_tokens > 0


def test_corrupt_and_truncated_objects_are_never_used(tmp_path):
    a = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)))
    _, nxt = conversation(a, random.Random(6), turns=1)
    files = sorted(f for f in os.listdir(tmp_path) if "." not in f)  # FULL pages
    for i, f in enumerate(files):
        p = tmp_path / f
        data = p.read_bytes()
        p.write_bytes(data[:-3] if i % 2 else data[:-40] + bytes(40))  # truncated / zeroed
    b = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)))
    r = greedy(nxt, 4)
    b.run([r])
    check_exact(b, r)  # recomputed, exact
    s = b.stats()
    assert r.metrics.storage_tokens == 0 and s["storage_failed_loads"] == 1
    # every bad object the read met is counted and deleted at once
    assert b.storage.store.counters["corrupt"] == b.storage.store.counters["deleted"] == len(files)


@pytest.mark.parametrize("name", ["tiny-hybrid", "gemma3-like", "jamba-like"])
def test_a_damaged_object_is_replaced_by_the_recomputed_data(tmp_path, name):
    """One flipped byte must not turn L3 reuse off for that prefix: the read that finds
    it deletes it, the request computes, its write-through stores the data afresh, and a
    fresh engine then reuses the whole prefix from L3 again."""
    a = engine(name, 4, FileBackend(str(tmp_path)))
    _, nxt = conversation(a, random.Random(16), turns=1)
    # a FULL page (named without a suffix): every resume past it reads it (a spare window
    # page, one of many since every boundary of a prompt is resumable, may not be read)
    files = sorted(f for f in os.listdir(tmp_path) if not f.startswith(".") and "." not in f)
    victim = tmp_path / files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    b = engine(name, 4, FileBackend(str(tmp_path)))
    r = greedy(nxt, 3)
    b.run([r])
    check_exact(b, r)
    assert r.metrics.storage_tokens == 0 and b.storage.store.counters["corrupt"] == 1 and b.storage.store.counters["deleted"] == 1
    for turn in range(2):  # the following turns, each on a fresh engine: reuse is back
        c = engine(name, 4, FileBackend(str(tmp_path)))
        r2 = greedy(nxt, 3)
        c.run([r2])
        check_exact(c, r2)
        assert r2.metrics.storage_tokens == page_floor(len(nxt) - 1, 4), turn
        assert c.storage.store.counters["corrupt"] == 0


def test_a_full_disk_still_serves(tmp_path, monkeypatch):
    store = FileBackend(str(tmp_path))

    def full(tmp, value):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_write", full)
    eng = engine("gemma3-like", 4, store)
    reqs, _ = conversation(eng, random.Random(7), turns=2)
    assert store.stats()["set_failures"] > 0 and eng.stats()["storage_saved_objects"] == 0
    assert reqs[-1].metrics.cached_tokens > 0
    check_flush(eng)


def test_a_read_only_store_counts_every_failure_and_logs_a_few_lines(tmp_path, monkeypatch, caplog):
    """Every refused write is an error in the engine's summary (not 0 while the log
    fills up), and the log says it once, then in summaries."""
    store = FileBackend(str(tmp_path))

    def read_only(tmp, value):
        raise OSError(30, "Read-only file system")

    eng = engine("tiny-hybrid", 1, store)
    assert eng.storage.witness.allows()  # the namespace's witness is stored before the disk turns read-only
    monkeypatch.setattr(store, "_write", read_only)
    with caplog.at_level("WARNING", logger="uniradix"):
        conversation(eng, random.Random(20), turns=2)
        eng.close()
        store.close()
    failed = store.stats()["set_failures"]
    assert failed > 100 and eng.stats()["storage_errors"] == failed
    lines = [r for r in caplog.records if "Read-only" in r.getMessage()]
    assert 1 <= len(lines) <= 3, [r.getMessage() for r in lines]


@pytest.fixture(scope="module")
def redis_url():
    import redis_server  # tests/hicache: starts redis-server on 127.0.0.1, stops it by PID
    with redis_server.redis_url() as url:
        yield url


@pytest.mark.parametrize("name", ["tiny-hybrid", "jamba-like", "gemma3-like"])
def test_two_engines_over_one_redis(redis_url, name):
    from uniradix.hicache.backends.redis import RedisBackend
    prefix = f"two-engines-{name}:"
    a = engine(name, 4, RedisBackend(redis_url, prefix=prefix))
    reqs, nxt = conversation(a, random.Random(8))
    b = engine(name, 4, RedisBackend(redis_url, prefix=prefix))
    r = greedy(nxt, 4)
    b.run([r])
    check_exact(b, r)
    last = reqs[-1]
    assert r.metrics.storage_tokens == page_floor(len(last.input_ids) + len(last.output_ids) - 1, 4)
    b.storage.backend.clear()


@pytest.mark.parametrize("name", ["tiny-hybrid", "jamba-like"])
def test_two_engines_over_one_mooncake_store(mooncake_shared, mooncake_srv, name):
    """Two engines, each with its own Mooncake client on one master: the second reuses
    what the first wrote. Neither client lends memory, so the objects sit in the
    session's client's segment and outlive the first engine's client."""
    from backend_contract import MOONCAKE_SIZES

    from uniradix.hicache.backends.mooncake import MooncakeBackend
    cfg = {"master": mooncake_srv.address, "prefix": f"two-engines-{name}:", **MOONCAKE_SIZES,
           "global_segment_size": 0}
    first = MooncakeBackend(cfg)
    a = engine(name, 4, first)
    reqs, nxt = conversation(a, random.Random(8))
    a.close()
    first.close()
    second = MooncakeBackend(cfg)
    try:
        b = engine(name, 4, second)
        r = greedy(nxt, 4)
        b.run([r])
        check_exact(b, r)
        last = reqs[-1]
        assert r.metrics.storage_tokens == page_floor(len(last.input_ids) + len(last.output_ids) - 1, 4)
        b.close()
        second.clear()
    finally:
        second.close()


class Gated(FileBackend):
    """A store whose page reads wait until the test opens the gate: a slow backend with
    no clock (the namespace's witness, read before the first read or write, is not held:
    writes would otherwise wait behind the gate too)."""

    def __init__(self, path):
        super().__init__(path)
        import threading
        self.gate = threading.Event()

    def batch_get(self, keys):
        if not all(k.endswith(".witness") for k in keys):
            self.gate.wait(30)
        return super().batch_get(keys)


def stored_conversation(tmp_path, name="jamba-like"):
    a = engine(name, 4, FileBackend(str(tmp_path)))
    _, nxt = conversation(a, random.Random(9), turns=1)
    return nxt


def test_timeout_policy_gives_up_and_computes_while_the_store_hangs(tmp_path):
    nxt = stored_conversation(tmp_path)
    store = Gated(str(tmp_path))
    b = engine("jamba-like", 4, store, hicache_storage_prefetch_policy="timeout", prefetch_timeout_base=0.05,
               prefetch_timeout_per_ki_token=0.0, prefetch_timeout_max=0.05)
    try:
        r = greedy(nxt, 3)
        b.run([r])                      # returns although the read never finished
        assert not store.gate.is_set()
        check_exact(b, r)
        assert r.metrics.storage_tokens == 0
        assert b.stats()["storage_prefetch_abandoned"] == 1
    finally:
        store.gate.set()
        b.close()
    check_flush(b)


def test_best_effort_never_holds_up_other_requests(tmp_path):
    nxt = stored_conversation(tmp_path)
    store = Gated(str(tmp_path))
    b = engine("jamba-like", 4, store, hicache_storage_prefetch_policy="best_effort")
    try:
        other = greedy([5] * 30, 6)     # nothing stored for it
        b.submit(other)
        b.step()                        # other is running
        r = greedy(nxt, 3)
        b.run([r])
        assert not store.gate.is_set()  # both served while the read hangs
        for x in (other, r):
            check_exact(b, x)
        assert r.metrics.storage_tokens == 0
    finally:
        store.gate.set()
        b.close()


def test_wait_complete_waits_for_the_store(tmp_path):
    import threading
    nxt = stored_conversation(tmp_path)
    store = Gated(str(tmp_path))
    b = engine("jamba-like", 4, store, hicache_storage_prefetch_policy="wait_complete", prefetch_timeout_max=0.0)
    opener = threading.Timer(0.2, store.gate.set)
    opener.start()
    try:
        r = greedy(nxt, 3)
        b.run([r])
        check_exact(b, r)
        assert r.metrics.storage_tokens > 0  # it waited past every timeout for the read
    finally:
        store.gate.set()
        opener.join()
        b.close()


def test_prefetch_settings_are_checked():
    with pytest.raises(ValueError, match="--hicache-storage-prefetch-policy must be one of"):
        Engine("tiny-hybrid", hicache_storage_prefetch_policy="eager")
    with pytest.raises(ValueError, match="prefetch_timeout_base"):
        Engine("tiny-hybrid", prefetch_timeout_base=-1)


def test_selective_write_through_writes_what_is_reused(tmp_path):
    store = FileBackend(str(tmp_path / "sel"))
    eng = engine("tiny-hybrid", 4, store, hicache_write_policy="write_through_selective",
                 write_through_threshold=2)
    rng = random.Random(10)
    once = [rng.randrange(256) for _ in range(40)]
    eng.run([greedy(once, 3)])
    assert eng.stats()["storage_saved_objects"] == 0  # seen once: stays on the device
    eng.run([greedy(once, 3)])                        # reused: now it goes down
    assert eng.stats()["storage_saved_objects"] > 0
    fresh = engine("tiny-hybrid", 4, FileBackend(str(tmp_path / "sel")))
    r = greedy(once, 2)
    fresh.run([r])
    check_exact(fresh, r)
    assert r.metrics.storage_tokens == page_floor(len(once) - 1, 4)
    with pytest.raises(ValueError, match="--hicache-write-policy write_back .* needs --enable-hierarchical-cache"):
        Engine("tiny-hybrid", hicache_write_policy="write_back")


@pytest.mark.parametrize("policy", ["wait_complete", "best_effort"])
def test_requests_waiting_behind_prefetches_are_not_refused(tmp_path, policy):
    """Device pools that hold two conversations, eight clients: while the pages are held
    by requests that are reading the store (not yet running), the next request waits;
    it is not told it can never fit. Later rounds are served from L3."""
    from uniradix.bench import MultiTurnWorkload, run_multiturn
    eng = Engine("tiny-hybrid", page_size=16, max_total_tokens=1024, storage=FileBackend(str(tmp_path)),
                 prefetch_threshold=32, hicache_storage_prefetch_policy=policy)
    wl = MultiTurnWorkload(clients=8, rounds=5, tokens_per_round=96, output_tokens=4, shared_prefix_tokens=0)
    rounds = run_multiturn(eng, wl)
    eng.close()
    assert sum(r.errors for r in rounds) == 0
    assert eng.stats()["storage_tokens"] > 0
    if policy == "wait_complete":
        assert rounds[-1].hit_rate > 0.7
    check_flush(eng)


class Buggy(FileBackend):
    """A backend with a bug: reads and writes raise something that is not StorageUnavailable."""

    def batch_get(self, keys):
        raise KeyError("bug in a user backend")

    def batch_set(self, keys, values):
        raise TypeError("another bug")


def test_a_buggy_backend_does_not_take_the_engine_down(tmp_path):
    a = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)))
    _, nxt = conversation(a, random.Random(12), turns=1)
    b = engine("tiny-hybrid", 4, Buggy(str(tmp_path)))
    r = greedy(nxt, 3)
    b.run([r])
    check_exact(b, r)
    assert r.metrics.storage_tokens == 0 and b.stats()["storage_errors"] == 2  # the read, the write
    b.close()


@pytest.mark.parametrize("name", ["tiny-hybrid", "qwen3-next-like", "gemma3-like", "full-only"])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_conversations_under_pressure_over_l3_stay_exact(tmp_path, name, page):
    """Six conversations on device pools that hold about two: turns come back from L3,
    requests wait and are evicted, and every token stays exact. Whether one is also
    preempted depends on how fast the store answers (a request still prefetching is not
    running), so preemption is asserted where it is deterministic: the engine and host
    tier suites."""
    eng = Engine(name, page_size=page, max_total_tokens=320, max_mamba_cache_size=24,
                 storage=FileBackend(str(tmp_path)), prefetch_threshold=page,
                 hicache_storage_prefetch_policy="wait_complete")
    rng = random.Random(13)
    convs = [[rng.randrange(256) for _ in range(30)] for _ in range(6)]
    from_store = 0
    for _ in range(3):
        reqs = [greedy(c, 4) for c in convs]
        eng.run(reqs)
        for r in reqs:
            check_exact(eng, r)
            check_work(r)
            from_store += r.metrics.storage_tokens
        check_ownership(eng)
        convs = [r.input_ids + r.output_ids + [rng.randrange(256) for _ in range(12)] for r in reqs]
    eng.close()
    s = eng.stats()
    assert from_store > 0 and s["errors"] == 0
    assert s["cache"]["components"]["full"]["evicted"] > 0
    check_flush(eng)


class Recording(FileBackend):
    """A file store that records each call and the thread it ran on (the calls about
    the namespace's witness apart: one read, and a write on first use, per engine)."""

    def __init__(self, path):
        super().__init__(path)
        self.calls = []
        self.witness_calls = []

    def _log(self, name, keys):
        import threading
        about_witness = bool(keys) and all(k.endswith(".witness") for k in keys)
        (self.witness_calls if about_witness else self.calls).append(
            (name, len(keys), threading.current_thread().name))

    def batch_exists(self, keys):
        self._log("batch_exists", keys)
        return super().batch_exists(keys)

    def batch_contains(self, keys):
        self._log("batch_contains", keys)
        return super().batch_contains(keys)

    def batch_get(self, keys):
        self._log("batch_get", keys)
        return super().batch_get(keys)

    def batch_set(self, keys, values):
        self._log("batch_set", keys)
        return super().batch_set(keys, values)

    def set_if_absent(self, key, value):
        self._log("set_if_absent", [key])
        return super().set_if_absent(key, value)


@pytest.mark.parametrize("name", ["tiny-hybrid", "full-only"])
def test_store_io_is_batched_and_off_the_scheduler_thread(tmp_path, name):
    """A 2,000-token request at page size 1 is written through in one membership call
    and one set (not one round trip per key), on the I/O thread; the scheduler's thread
    never waits on the store, for writes or for reads."""
    import threading
    store = Recording(str(tmp_path))
    eng = Engine(name, page_size=1, max_total_tokens=4096, storage=store, prefetch_threshold=1)
    rng = random.Random(17)
    r = greedy([rng.randrange(256) for _ in range(2000)], 3)
    eng.run([r])
    check_exact(eng, r)
    writes = [c for c in store.calls if c[0] in ("batch_contains", "batch_set")]
    assert [c[0] for c in writes] == ["batch_contains", "batch_set"], store.calls
    assert writes[0][1] >= 2000 and writes[1][1] == writes[0][1]
    main = threading.main_thread().name
    assert all(t != main for _, _, t in store.calls), store.calls
    assert [c[0] for c in store.witness_calls] == ["batch_get", "set_if_absent", "batch_get"]
    # the next turn, on a fresh engine: reads are batched and off the scheduler's thread too
    store.calls.clear()
    store.witness_calls.clear()
    b = Engine(name, page_size=1, max_total_tokens=4096, storage=store, prefetch_threshold=1,
               hicache_storage_prefetch_policy="wait_complete")
    r2 = greedy(r.input_ids + r.output_ids + [1, 2, 3], 2)
    b.run([r2])
    check_exact(b, r2)
    assert r2.metrics.storage_tokens > 0
    assert all(t != main for _, _, t in store.calls), store.calls
    assert sum(1 for c in store.calls if c[0] == "batch_get") == 1
    assert [c[0] for c in store.witness_calls] == ["batch_get"]  # b found a's witness, once
    assert all(t != main for _, _, t in store.witness_calls)
    # a second write of the same path reads nothing from the pools: its keys are believed
    # stored, and only re-checked, all in one membership call
    store.calls.clear()
    job = b.storage.store.prepare_cached(r2.input_ids + r2.output_ids[:-1])  # what b cached
    assert job.keys == [] and len(job.believed) >= 2000
    assert b.storage.store.commit(job) == 0
    assert [c[:2] for c in store.calls] == [("batch_contains", len(job.believed))], store.calls
    eng.close()
    b.close()


def test_other_weights_of_one_architecture_do_not_share(tmp_path):
    """The namespace identifies the weights, not only the config: an engine given other
    weights for the same preset must not read the first one's KV (it would answer
    wrongly); the same weights again, or a fleet's own model name, share."""
    from uniradix.model import init_weights, preset
    cfg = preset("tiny-hybrid")
    mine, other = init_weights(cfg), init_weights(cfg.with_(seed=9))
    a = Engine(cfg, weights=mine, page_size=4, max_total_tokens=2048, storage=FileBackend(str(tmp_path)),
               prefetch_threshold=1)
    _, nxt = conversation(a, random.Random(18), turns=1)
    b = Engine(cfg, weights=other, page_size=4, max_total_tokens=2048, storage=FileBackend(str(tmp_path)),
               prefetch_threshold=1)
    r = greedy(nxt, 3)
    b.run([r])
    check_exact(b, r)  # exact for b's own weights: nothing of a's was used
    assert r.metrics.storage_tokens == 0
    c = Engine(cfg, weights={k: v for k, v in mine.items()}, page_size=4, max_total_tokens=2048,
               storage=FileBackend(str(tmp_path)), prefetch_threshold=1)
    r2 = greedy(nxt, 3)
    c.run([r2])
    check_exact(c, r2)
    assert r2.metrics.storage_tokens > 0  # the same weights: the same namespace
    # a fleet that names its models itself: the name is the namespace
    named = [Engine(cfg, weights=w, page_size=4, max_total_tokens=2048, storage=FileBackend(str(tmp_path)),
                    prefetch_threshold=1, model_fingerprint="acme/tiny@v1") for w in (mine, mine)]
    r3 = greedy(nxt, 3)
    named[0].run([r3])
    assert r3.metrics.storage_tokens == 0  # nothing was written under that name yet
    r4 = greedy(nxt + [5, 6, 7, 8, 9], 3)
    named[1].run([r4])
    check_exact(named[1], r4)
    assert r4.metrics.storage_tokens > 0
    with pytest.raises(ValueError, match="model_fingerprint"):
        Engine(cfg, storage=FileBackend(str(tmp_path)), model_fingerprint="")


def test_with_a_secret_forged_objects_are_misses(tmp_path, monkeypatch):
    """With a secret, an object rewritten by someone without it (a fresh, valid unkeyed
    checksum over other data) is refused, counted, deleted and recomputed; engines that
    share the secret share the data."""
    from uniradix.hicache import page_keys
    from uniradix.hicache.objects import pack_object, unpack_object
    secret = "s3cret-for-the-fleet"
    a = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)), auth_secret=secret)
    (first,), nxt = conversation(a, random.Random(19), turns=1)
    b = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)), auth_secret=secret)
    r = greedy(nxt, 3)
    b.run([r])
    check_exact(b, r)
    assert r.metrics.storage_tokens > 0  # same secret: shared
    # a writer without the secret replaces one FULL page with its own data and checksum
    ns, seed = a.storage.store.namespace, a.storage.store.namespace.seed()
    key = page_keys(nxt, ns)[2]
    path = tmp_path / key
    payload = unpack_object(path.read_bytes(), key, seed, secret.encode())
    path.write_bytes(pack_object(key, bytes(len(payload)), seed))
    monkeypatch.setenv("UNIRADIX_L3_SECRET", secret)  # the variable works as the keyword does
    c = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)))
    r2 = greedy(nxt, 3)
    c.run([r2])
    check_exact(c, r2)
    assert r2.metrics.storage_tokens == 0
    assert c.storage.store.counters["unauthenticated"] == 1 and c.storage.store.counters["deleted"] == 1
    d = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)))  # c stored the recomputed page again
    r3 = greedy(nxt, 3)
    d.run([r3])
    check_exact(d, r3)
    assert r3.metrics.storage_tokens > 0


def test_pending_writes_count_only_writes_not_yet_done(tmp_path):
    """The gauge of pending writes (/metrics) says what the store has yet to take, also
    on an idle server, whose steps no longer prune the writes that finished."""
    from concurrent.futures import wait
    eng = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)))
    eng.submit(greedy(list(range(3, 60)), 3))
    while eng.waiting or eng.running or eng.prefetching:
        eng.step()
    assert eng.storage.writing   # handed to the write thread, not pruned (no step since)
    wait(eng.storage.writing, timeout=60)
    assert eng.stats()["storage_pending_writes"] == 0
    eng.close()


def test_engines_with_other_secrets_leave_each_others_objects_alone(tmp_path):
    """A fleet mid-rotation (the old secret and the new one), or engines with and
    without a secret, on one store: each never even finds the objects it could not
    authenticate (their keys carry a digest of the secret), so none is counted as forged
    or deleted, and each keeps its own reuse."""
    (first,), nxt = conversation(engine("tiny-hybrid", 4, FileBackend(str(tmp_path)), auth_secret="old"),
                                 random.Random(20), turns=1)
    whole = page_floor(len(nxt) - 1, 4)
    for secret in ("new", None):
        other = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)), auth_secret=secret)
        r = greedy(nxt, 3)
        other.run([r])
        check_exact(other, r)
        s = other.stats()
        assert r.metrics.storage_tokens == 0 and s["storage_corrupt_objects"] == 0 and s["storage_loads"] == 0
    again = engine("tiny-hybrid", 4, FileBackend(str(tmp_path)), auth_secret="old")
    r = greedy(nxt, 3)
    again.run([r])
    check_exact(again, r)
    assert r.metrics.storage_tokens == page_floor(len(first.input_ids) + len(first.output_ids) - 1, 4) <= whole
    assert again.stats()["storage_corrupt_objects"] == 0


def test_window_of_one_token_resumes_from_l3_through_the_host_tier(tmp_path):
    """A window of one token reads nothing before the boundary: L3 has no SWA page to
    load for it, and the load through the host tier must not expect one."""
    from uniradix.model import HybridConfig
    cfg = HybridConfig(pattern="SF", window=1)

    def mk():
        return Engine(cfg, page_size=4, max_total_tokens=2048, storage=FileBackend(str(tmp_path)),
                      prefetch_threshold=1, enable_hierarchical_cache=True)

    a = mk()
    r1 = greedy(list(range(30)), 5)
    a.run([r1])
    check_exact(a, r1)
    b = mk()
    r = greedy(r1.input_ids + r1.output_ids + [3, 4, 5], 4)
    b.run([r])
    check_exact(b, r)
    assert r.metrics.cached_tokens == r.metrics.storage_tokens == page_floor(
        len(r1.input_ids) + len(r1.output_ids) - 1, 4)
