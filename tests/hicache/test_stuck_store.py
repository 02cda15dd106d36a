"""A store that cannot answer must cost reuse, never the engine: an entry under a key's
name that is not a regular file (a FIFO would block a plain open() for good, a
directory would look present forever) is a counted miss, removed, and stored again by
the next write; a backend whose reads hang leaves every request served, the scheduler
free, and shutdown bounded.

`bounded` runs a call on a daemon thread and says whether it ended: a guard against the
very hangs tested here (a hang fails the test instead of freezing the run), never a
measure of speed."""
import os
import random
import stat
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
from engine_checks import check_exact, greedy  # noqa: E402

from uniradix.engine import Engine  # noqa: E402
from uniradix.hicache import page_keys  # noqa: E402
from uniradix.hicache.backends.file import FileBackend  # noqa: E402
from uniradix.tree.component import page_floor  # noqa: E402

POLICIES = ["best_effort", "wait_complete", "timeout"]
GUARD_S = 300.0   # a hang is for ever: a loaded machine is never this slow on these calls


def bounded(fn, seconds=GUARD_S) -> bool:
    done, box = threading.Event(), {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    ended = done.wait(seconds)
    if "error" in box:
        raise box["error"]
    return ended


def release_fifo(path: Path) -> None:
    """Open a FIFO's write end once, so that a reader stuck opening it returns (the code
    before this fix left its I/O thread there, and the interpreter would wait for it)."""
    try:
        if stat.S_ISFIFO(os.lstat(path).st_mode):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def engine(path, **kw):
    return Engine("tiny-hybrid", page_size=4, max_total_tokens=2048, storage=FileBackend(str(path)),
                  prefetch_threshold=1, **kw)


def stored(tmp_path):
    """A conversation's first turn in the store; the next prompt, and its page keys."""
    a = engine(tmp_path)
    rng = random.Random(11)
    r = greedy([rng.randrange(256) for _ in range(60)], 5)
    a.run([r])
    nxt = r.input_ids + r.output_ids + [rng.randrange(256) for _ in range(6)]
    return nxt, page_keys(nxt, a.storage.store.namespace)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_entry_that_is_not_a_file_is_a_counted_miss_and_is_replaced(tmp_path, kind, policy):
    nxt, keys = stored(tmp_path)
    victim = tmp_path / keys[3]
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    else:
        victim.mkdir()
        (victim / "inside").write_bytes(b"x")
    b = engine(tmp_path, hicache_storage_prefetch_policy=policy)
    r = greedy(nxt, 3)
    try:
        assert bounded(lambda: b.run([r])), "the request hung on the entry"
        check_exact(b, r)
        assert r.metrics.storage_tokens < page_floor(len(nxt) - 1, 4)   # not past the entry
        s = b.stats()
        assert s["storage_errors"] >= 1 and s["storage"]["backend"]["unreadable"] >= 1
        assert victim.is_file() and not victim.is_symlink()   # rewritten by b's write-through
        assert bounded(b.close)
        c = engine(tmp_path, hicache_storage_prefetch_policy=policy)
        r2 = greedy(nxt, 3)
        assert bounded(lambda: c.run([r2]))
        check_exact(c, r2)
        assert r2.metrics.storage_tokens == page_floor(len(nxt) - 1, 4)   # the whole prefix again
        assert c.stats()["storage_errors"] == 0
    finally:
        release_fifo(victim)


@pytest.mark.parametrize("kind", ["symlink", "socket"])
def test_links_and_sockets_are_neither_followed_nor_opened(tmp_path, kind, monkeypatch):
    import socket
    nxt, keys = stored(tmp_path)
    victim = tmp_path / keys[1]
    secret = tmp_path.parent / f"{tmp_path.name}-outside"
    secret.write_bytes(victim.read_bytes())   # a valid object outside the store
    victim.unlink()
    sock = None
    if kind == "symlink":
        victim.symlink_to(secret)
    else:
        sock = socket.socket(socket.AF_UNIX)
        monkeypatch.chdir(tmp_path)   # a socket's path is limited to ~100 bytes
        sock.bind(victim.name)
    try:
        b = engine(tmp_path)
        r = greedy(nxt, 3)
        assert bounded(lambda: b.run([r]))
        check_exact(b, r)
        assert r.metrics.storage_tokens < page_floor(len(nxt) - 1, 4)
        assert b.stats()["storage"]["backend"]["unreadable"] == 1
        assert victim.is_file() and not victim.is_symlink() and secret.exists()
    finally:
        if sock is not None:
            sock.close()


def test_a_file_larger_than_any_object_is_never_read_into_memory(tmp_path):
    """A file under a key's name grown past any object (a sparse file costs no disk, and
    a plain read of one of many GB takes the server's memory with it): the reader sees
    its size first, reads none of it, counts it, removes it, and the next write stores
    the key again, so a fresh engine reuses the whole prefix."""
    nxt, keys = stored(tmp_path)
    victim = tmp_path / keys[2]
    with open(victim, "r+b") as f:
        f.truncate(64 << 20)   # sparse
    b = engine(tmp_path, hicache_storage_prefetch_policy="wait_complete")
    r = greedy(nxt, 3)
    b.run([r])
    check_exact(b, r)
    assert r.metrics.storage_tokens < page_floor(len(nxt) - 1, 4)
    s = b.stats()
    assert s["storage"]["backend"]["unreadable"] == 1 and s["storage_errors"] >= 1
    assert s["storage"]["backend"]["bytes_read"] < 1 << 20   # the object's size, not the file's
    assert victim.is_file() and victim.stat().st_size < 1 << 20   # rewritten by b's write-through
    b.close()
    c = engine(tmp_path)
    r2 = greedy(nxt, 3)
    c.run([r2])
    check_exact(c, r2)
    assert r2.metrics.storage_tokens == page_floor(len(nxt) - 1, 4)
    assert c.stats()["storage_errors"] == 0


class Hanging(FileBackend):
    """A file store whose reads never return until the test lets them (a server that
    stopped answering, a network mount gone away)."""

    def __init__(self, path):
        super().__init__(path)
        self.release = threading.Event()

    def batch_get(self, keys):
        self.release.wait()
        return super().batch_get(keys)

    def batch_exists(self, keys):
        self.release.wait()
        return super().batch_exists(keys)


def test_a_step_never_blocks_on_a_read_that_hangs(tmp_path):
    """wait_complete makes the request wait for its read, not the scheduler: while the
    store hangs a step returns and stats() answers; once it answers the read is used."""
    nxt, _ = stored(tmp_path)
    store = Hanging(str(tmp_path))
    b = Engine("tiny-hybrid", page_size=4, max_total_tokens=2048, storage=store, prefetch_threshold=30,
               hicache_storage_prefetch_policy="wait_complete")
    r = greedy(nxt, 3)
    b.submit(r)
    try:
        assert bounded(b.step) and b.prefetching
        other = greedy([9] * 20, 3)     # too short to read from L3: served while r waits
        b.submit(other)
        assert bounded(lambda: [b.step() for _ in range(40)]) and other.status == "finished"
        assert b.prefetching and bounded(b.stats)
    finally:
        store.release.set()
    assert bounded(lambda: b.run([r]))
    check_exact(b, r)
    assert r.metrics.storage_tokens > 0   # it waited for its read, and used it
    b.close()


def test_wait_complete_over_a_store_that_hangs(tmp_path):
    """wait_complete waits for a read, not for ever: a step never blocks on the store
    (so stats() and /metrics answer), the request computes once io_timeout passes (a
    counted error), reads stuck in the store make later requests compute at once
    instead of queueing behind them, close() gives pending writes its timeout, and no
    storage thread can keep the process alive."""
    nxt, _ = stored(tmp_path)
    store = Hanging(str(tmp_path))
    b = Engine("tiny-hybrid", page_size=4, max_total_tokens=2048, storage=store, prefetch_threshold=1,
               hicache_storage_prefetch_policy="wait_complete", io_timeout=0.3)
    try:
        first = greedy(nxt, 3)
        b.submit(first)
        assert bounded(b.step) and b.prefetching    # waiting for its read, the step returned
        assert bounded(b.stats)                     # what /metrics reads
        second = greedy(nxt[:50] + [7, 7, 7], 3)
        assert bounded(lambda: b.run([first, second]))
        s = b.stats()
        assert s["storage_prefetch_abandoned"] == 2 and s["storage_errors"] >= 2
        rest = [greedy(nxt[:50] + [i, i, i], 3) for i in range(4)]
        assert bounded(lambda: b.run(rest))
        for r in (first, second, *rest):
            check_exact(b, r)
            assert r.status == "finished" and r.metrics.storage_tokens == 0
        assert b.stats()["storage_prefetches"] == 2    # both read threads stuck: the rest computed
        threads = [t for t in threading.enumerate() if t.name.startswith("uniradix-l3")]
        assert threads and all(t.daemon for t in threads)
        assert bounded(lambda: b.close(timeout=0.2))   # its writes wait on the store too
        assert b.stats()["storage_pending_writes"] == 0
    finally:
        store.release.set()


def test_metrics_say_what_a_hanging_store_cost(tmp_path, monkeypatch):
    """While the store hangs, reads given up and writes dropped for want of room in the
    write queue are data a client never gets: /metrics says how many, and how many
    writes are waiting."""
    from uniradix.hicache import l3
    from uniradix.server.metrics import ServerMetrics
    monkeypatch.setattr(l3, "MAX_PENDING_WRITES", 2)
    store = Hanging(str(tmp_path))
    b = Engine("tiny-hybrid", page_size=4, max_total_tokens=2048, storage=store, prefetch_threshold=1,
               prefetch_timeout_base=0.05, prefetch_timeout_max=0.05, io_timeout=0.3)
    try:
        rs = [greedy([i + 3] * 30, 2) for i in range(5)]
        assert bounded(lambda: b.run(rs[:1]))                # its read is given up, its write waits
        assert bounded(lambda: b.run(rs[1:]))                # reads stuck: computed; writes pile up
        s = b.stats()
        assert s["storage_prefetch_abandoned"] >= 1 and s["storage_writes_dropped"] >= 1
        text = ServerMetrics().render({"engine": s, "output_tokens": 0, "sessions": 0}).decode()
        for name, key in (("uniradix_storage_prefetches_abandoned_total", "storage_prefetch_abandoned"),
                          ("uniradix_storage_writes_dropped_total", "storage_writes_dropped"),
                          ("uniradix_storage_prefetches_total", "storage_prefetches"),
                          ("uniradix_storage_pending_writes", "storage_pending_writes")):
            assert f"{name} {float(s[key])}" in text, name
        assert s["storage_pending_writes"] >= 1
    finally:
        store.release.set()
    assert bounded(lambda: b.close(timeout=5))


def test_io_threads_are_daemons_and_shutdown_never_waits_for_a_stuck_call():
    from uniradix.hicache.io_threads import DaemonThreads
    gate, started = threading.Event(), threading.Event()

    def stuck_call():
        started.set()
        return gate.wait()

    pool = DaemonThreads(1, "uniradix-l3-test")
    try:
        stuck = pool.submit(stuck_call)
        assert started.wait(GUARD_S)
        queued = pool.submit(lambda: 1)
        assert all(t.daemon for t in pool._threads)
        assert bounded(lambda: pool.shutdown(timeout=0.05))   # returns with the call still stuck
        assert queued.cancelled() and not stuck.done()
        with pytest.raises(RuntimeError, match="shut down"):
            pool.submit(lambda: 2)
    finally:
        gate.set()
    assert stuck.result(GUARD_S) is True
