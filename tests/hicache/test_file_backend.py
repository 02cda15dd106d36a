"""The file backend and the backend factory: clear, whole writes, failures that cost one
key and never the engine, counted and warned about once (then in summaries). The
StorageBackend contract (round trips, exists, contains, replace, delete, clear, sharing,
counters, bad keys) runs on it in test_backend_contract.py; configuration mistakes are in
test_backend_config.py."""
import errno
import json
import logging
import os
import pathlib
import subprocess
import threading

import pytest
from backend_contract import DictBackend, keys, read_only_later

from uniradix.hicache import StorageUnavailable
from uniradix.hicache.backends import make_backend, parse_extra_config
from uniradix.hicache.backends.file import FileBackend

K = [f"{i:064x}" for i in range(1, 9)]


@pytest.fixture
def fb(tmp_path):
    return FileBackend(str(tmp_path / "l3"))


def test_clear_removes_key_files_and_temporaries_only(fb):
    fb.batch_set(K[:3], [b"1", b"2", b"3"])
    pathlib.Path(fb.path, "notes.txt").write_text("not ours")
    pathlib.Path(fb.path, f".{K[4][:16]}.dead.tmp").write_text("left by a crash")
    fb.clear()
    assert sorted(os.listdir(fb.path)) == ["notes.txt"]


def test_no_temporaries_are_left_and_writes_are_whole(fb):
    fb.batch_set(K, [bytes([i]) * 1000 for i in range(len(K))])
    assert sorted(os.listdir(fb.path)) == sorted(K)


def test_bad_keys_and_arguments(fb):
    with pytest.raises(ValueError):
        fb.batch_get(["../../etc/passwd"])
    with pytest.raises(ValueError):
        fb.batch_set([K[0]], [])


def test_disk_full_costs_the_key_not_the_engine(fb, monkeypatch):
    real = fb._write
    calls = []

    def write(tmp, value):
        calls.append(tmp)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(tmp, value)

    monkeypatch.setattr(fb, "_write", write)
    assert fb.batch_set(K[:3], [b"a", b"b", b"c"]) == [True, False, True]
    assert fb.stats()["set_failures"] == 1
    assert fb.batch_get(K[:3]) == [b"a", None, b"c"]
    assert not [n for n in os.listdir(fb.path) if n.endswith(".tmp")]


def test_a_real_full_filesystem(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}")
    try:
        fb = FileBackend(str(mnt))
        ok = fb.batch_set(K[:4], [os.urandom(30_000) for _ in range(4)])
        assert ok[0] and not all(ok)
        assert fb.stats()["set_failures"] == ok.count(False)
        got = fb.batch_get(K[:4])
        assert [g is not None for g in got] == ok
        assert not [n for n in os.listdir(mnt) if n.endswith(".tmp")]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_vanished_directory_is_unavailable(fb):
    fb.batch_set([K[0]], [b"x"])
    fb.clear()
    os.rmdir(fb.path)
    calls = [lambda: fb.batch_set([K[0]], [b"x"]), lambda: fb.batch_exists(K[:2]),
             lambda: fb.batch_contains(K[:2]), lambda: fb.delete(K[0]), fb.clear]
    for call in calls:   # a miss is not what a missing directory means
        with pytest.raises(StorageUnavailable, match="gone|cannot list"):
            call()
    assert fb.stats()["errors"] == len(calls)


def test_a_read_only_store_counts_every_failure_and_warns_once(tmp_path, caplog):
    # A store that turns read-only fails every set: each is counted, but the log gets
    # the first failure with its reason and then one summary (here at close), not 500 lines.
    path = str(tmp_path / "ro")
    with read_only_later(path) as freeze:
        fb = FileBackend(path)
        assert fb.batch_set(K[:1], [b"x"]) == [True]
        freeze()
        caplog.clear()   # (the start-up warning)
        with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
            ok = [fb.batch_set([k], [b"v"]) for k in keys(300, ns="ro")]   # page by page
            ok += [fb.batch_set(keys(200, start=300, ns="ro"), [b"v"] * 200)]
            st = fb.stats()
            assert sum(ok, []) == [False] * 500
            assert st["sets"] == 501 and st["set_failures"] == 500 and st["errors"] == 0
            lines = [r.getMessage() for r in caplog.records]
            assert len(lines) == 1, lines
            assert path in lines[0] and "storing" in lines[0]
            assert "Read-only file system" in lines[0] or "Permission denied" in lines[0]
            fb.close()
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2 and "499 more failed sets" in lines[1], lines
        assert fb.batch_get(K[:1]) == [b"x"]              # reads still work
        assert not [n for n in os.listdir(path) if n.endswith(".tmp")]


def test_failures_logged_again_after_the_interval(fb, monkeypatch, caplog):
    now = [100.0]
    fb.failure_log.clock = lambda: now[0]   # no sleeping
    caplog.clear()

    def write(tmp, value):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fb, "_write", write)
    with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
        fb.batch_set(K[:4], [b"x"] * 4)        # 1 line, 3 held back
        now[0] += 29
        fb.batch_set(K[4:6], [b"x"] * 2)       # still within 30 s
        assert len(caplog.records) == 1
        now[0] += 2
        fb.batch_set(K[6:7], [b"x"])           # 31 s on: one summary of the 6 since
        fb.batch_set(K[7:8], [b"x"])
        msgs = [r.getMessage() for r in caplog.records]
        assert len(msgs) == 2 and "6 more failed sets in the last 31 s" in msgs[1]
        assert "No space left on device" in msgs[1]
        fb.close()
        msgs = [r.getMessage() for r in caplog.records]
        assert len(msgs) == 3 and "1 more failed sets" in msgs[2]
        fb.close()                             # nothing left to report
        assert len(caplog.records) == 3
    assert fb.stats()["set_failures"] == 8


def test_contains_stats_each_key_and_never_raises_for_one(fb, caplog):
    # A key whose entry is not a regular file (here a symlink loop, which a stat would
    # fail on: ELOOP) is absent, counted as unreadable, warned about once, and removed;
    # the other keys are answered.
    fb.batch_set([K[0], K[2]], [b"a", b"c"])
    for k in K[3:6]:
        os.symlink(k, os.path.join(fb.path, k))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
        assert fb.batch_contains(K[:6]) == [True, False, True, False, False, False]
    st = fb.stats()
    assert st["errors"] == st["unreadable"] == 3 and st["exists_calls"] == 1
    assert len(caplog.records) == 1 and "symbolic link" in caplog.records[0].getMessage()
    assert not any(os.path.lexists(os.path.join(fb.path, k)) for k in K[3:6])
    assert fb.batch_exists(K[2:]) == 1
    assert fb.batch_get(K[3:4]) == [None] and fb.stats()["errors"] == 3   # gone: a plain miss


def test_only_regular_files_are_read(fb, monkeypatch):
    """A FIFO (a plain open() would wait for a writer for ever), a directory, a socket
    and a link to a valid object under keys' names: each read is a miss at once, counted
    as unreadable, and the entry removed; a write, plain or set-if-absent, stores the key
    even over a directory (a rename cannot replace one)."""
    import socket
    target = os.path.join(os.path.dirname(fb.path), "outside")
    with open(target, "wb") as f:
        f.write(b"a valid-looking object")
    p = [os.path.join(fb.path, k) for k in K[:6]]
    os.mkfifo(p[0])
    os.mkdir(p[1])
    with open(os.path.join(p[1], "x"), "wb") as f:
        f.write(b"x")
    monkeypatch.chdir(fb.path)   # a socket's path is limited to ~100 bytes
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(K[2])
    os.symlink(target, p[3])
    got = []
    reader = threading.Thread(target=lambda: got.append(fb.batch_get(K[:4])), daemon=True)
    try:
        reader.start()
        reader.join(120)   # a guard: a read that waits on the FIFO fails here, not hangs the run
        assert got == [[None] * 4]
    finally:
        sock.close()
        if os.path.lexists(p[0]):   # let a reader stuck opening the FIFO go
            os.close(os.open(p[0], os.O_WRONLY | os.O_NONBLOCK))
    st = fb.stats()
    assert st["unreadable"] == st["errors"] == 4 and st["hits"] == 0
    assert not any(os.path.lexists(x) for x in p[:4]) and os.path.exists(target)
    os.mkdir(p[4])
    os.mkdir(p[5])
    assert fb.batch_set([K[4]], [b"v4"]) == [True] and fb.set_if_absent(K[5], b"v5") is True
    assert fb.batch_get(K[4:6]) == [b"v4", b"v5"] and fb.stats()["unreadable"] == 6
    assert fb.set_if_absent(K[5], b"again") is False and fb.batch_get(K[5:6]) == [b"v5"]


def test_values_are_checked_before_any_write(fb):
    with pytest.raises(TypeError, match="bytes"):
        fb.batch_set(K[:2], [b"ok", "text"])
    assert os.listdir(fb.path) == []


def test_start_up_warns_that_a_local_directory_is_not_shared(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
        fb = FileBackend(str(tmp_path / "x"))
    assert fb.fstype != "unknown" and fb.mount != "?"
    if fb.shared() is False:  # this machine's /tmp: ext4, tmpfs, overlay...
        assert "node-local filesystem" in caplog.text and fb.fstype in caplog.text
        assert fb.path in fb.sharing_hint()
    else:
        assert "not shared between machines" in caplog.text or fb.shared()


def test_the_filesystem_of_a_path_is_its_longest_mount(tmp_path):
    from uniradix.hicache.backends.file import filesystem_of
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\n"
                      "server:/export /mnt/shared nfs4 rw 0 0\n"
                      "tmpfs /mnt/shared/scratch tmpfs rw 0 0\n"
                      "host:/x /mnt/with\\040space cifs rw 0 0\n")
    assert filesystem_of("/mnt/shared/uniradix", str(mounts)) == ("nfs4", "/mnt/shared")
    assert filesystem_of("/mnt/shared/scratch/a", str(mounts)) == ("tmpfs", "/mnt/shared/scratch")
    assert filesystem_of("/mnt/sharedx", str(mounts)) == ("ext4", "/")   # a prefix is not a mount above it
    assert filesystem_of("/mnt/with space/y", str(mounts)) == ("cifs", "/mnt/with space")
    assert filesystem_of("/x", str(tmp_path / "absent")) == ("unknown", "?")


def test_factory_and_extra_config(tmp_path):
    b = make_backend("file", json.dumps({"path": str(tmp_path / "a"), "prefetch_threshold": 64}))
    assert isinstance(b, FileBackend) and b.path == str(tmp_path / "a")
    f = tmp_path / "cfg.json"
    f.write_text(json.dumps({"path": str(tmp_path / "b")}))
    assert make_backend("file", f"@{f}").path == str(tmp_path / "b")
    with pytest.raises(ValueError, match="unknown setting"):
        make_backend("file", {"path": str(tmp_path), "colour": "red"})
    with pytest.raises(ValueError, match="unknown storage backend"):
        make_backend("s3")
    with pytest.raises(ValueError, match="JSON"):
        parse_extra_config("{not json")
    with pytest.raises(ValueError, match="object"):
        parse_extra_config("[1, 2]")
    with pytest.raises(ValueError, match="cannot read"):
        parse_extra_config(f"@{tmp_path / 'missing.json'}")
    assert parse_extra_config(None) == {}


def test_dynamic_backend_loads_a_user_class():
    b = make_backend("dynamic", {"module_path": __name__, "class_name": "DictBackend", "tag": "t"})
    assert isinstance(b, DictBackend) and b.tag == "t"
    with pytest.raises(ValueError, match="module_path"):
        make_backend("dynamic", {"class_name": "DictBackend"})
    with pytest.raises(ValueError, match="cannot load"):
        make_backend("dynamic", {"module_path": __name__, "class_name": "Nope"})
    with pytest.raises(ValueError, match="not a StorageBackend"):
        make_backend("dynamic", {"module_path": "json", "class_name": "JSONDecoder"})
