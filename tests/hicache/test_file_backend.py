"""The file backend and the backend factory: clear, whole writes, failures that cost one
key and never the engine. The StorageBackend contract (round trips, exists, replace,
delete, clear, sharing, counters; not yet bad keys, see FileStore.known_gaps there) runs
on it in test_backend_contract.py."""
import errno
import json
import logging
import os
import pathlib
import subprocess

import pytest

from uniradix.hicache import StorageBackend, StorageUnavailable
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
    with pytest.raises(StorageUnavailable):
        fb.batch_set([K[0]], [b"x"])


def test_start_up_warns_that_a_local_directory_is_not_shared(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
        FileBackend(str(tmp_path / "x"))
    assert "not shared between machines" in caplog.text


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


class DictBackend(StorageBackend):
    """A user backend for the dynamic loader test."""

    name = "dict"

    def __init__(self, tag="x"):
        self.tag, self.d = tag, {}

    def batch_exists(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.d:
            n += 1
        return n

    def batch_get(self, keys):
        return [self.d.get(k) for k in keys]

    def batch_set(self, keys, values):
        self.d.update(zip(keys, values))
        return [True] * len(keys)

    def delete(self, key):
        return self.d.pop(key, None) is not None

    def clear(self):
        self.d.clear()


def test_dynamic_backend_loads_a_user_class():
    b = make_backend("dynamic", {"module_path": __name__, "class_name": "DictBackend", "tag": "t"})
    assert isinstance(b, DictBackend) and b.tag == "t"
    with pytest.raises(ValueError, match="module_path"):
        make_backend("dynamic", {"class_name": "DictBackend"})
    with pytest.raises(ValueError, match="cannot load"):
        make_backend("dynamic", {"module_path": __name__, "class_name": "Nope"})
    with pytest.raises(ValueError, match="not a StorageBackend"):
        make_backend("dynamic", {"module_path": "json", "class_name": "JSONDecoder"})
