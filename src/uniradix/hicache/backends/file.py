"""The file backend: one file per key in a directory. Writes go to a temporary file in
the same directory and are renamed into place, so a reader sees a whole object or
none, even with several engines writing the same key.

A set that fails (disk full, read-only) costs that key: False, counted in set_failures,
warned about once and then in summaries (log_limit.py). A directory that is gone is the
store unavailable (StorageUnavailable) from any call. A path that cannot be a writable
directory is a ValueError at start-up."""
from __future__ import annotations

import logging
import os
import threading
import uuid

from ..log_limit import LogLimiter
from ..storage import KEY_RE, StorageBackend, StorageUnavailable, check_key

log = logging.getLogger("uniradix.hicache")

DEFAULT_DIR = "/tmp/hicache"
SETTINGS = ("path", "fsync")
COUNTERS = ("gets", "hits", "sets", "set_failures", "errors", "bytes_written", "bytes_read",
            "exists_calls", "deletes")


class FileBackend(StorageBackend):
    """`path`: the directory (created if missing; it must be writable). `fsync`: flush
    each object to disk before the rename (durable across a crash, slower)."""

    name = "file"

    def __init__(self, path: str = DEFAULT_DIR, fsync: bool = False) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError(f"file backend: path must be a non-empty string (a directory), "
                             f"got {path!r}")
        if not isinstance(fsync, bool):
            raise ValueError(f"file backend: fsync must be true or false, got {fsync!r}")
        self.path = os.path.abspath(path)
        self.fsync = fsync
        _check_writable_dir(self.path)
        log.warning("file backend at %s: a node-local directory is not shared between machines "
                    "unless it is a shared mount (NFS, Lustre, ...)", self.path)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()
        self.failure_log = LogLimiter(log, f"file backend at {self.path}")

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self.counters[k] += v

    def _file(self, key: str) -> str:
        return os.path.join(self.path, check_key(key))

    def _files(self, keys: list[str]) -> list[str]:
        """Every key checked before any I/O: a bad key in a batch touches nothing."""
        return [self._file(k) for k in keys]

    def _present(self, f: str) -> bool:
        """One stat; a key it cannot tell about (EACCES, EIO) is absent, counted and
        logged, never raised."""
        try:
            os.stat(f)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            self._require_dir(e)
            self._count(errors=1)
            self.failure_log.failure("failed existence checks", "checking %s failed: %s", f, e)
            return False

    def _require_dir(self, cause: OSError | None = None) -> None:
        """After a miss or a failure: the whole directory gone is the store unavailable
        (raised, counted), not a miss or a per-key failure (one stat of it says which)."""
        if not os.path.isdir(self.path):
            self._count(errors=1)
            raise StorageUnavailable(f"file backend: directory {self.path} is gone") from cause

    def batch_exists(self, keys: list[str]) -> int:
        files = self._files(keys)
        self._count(exists_calls=1)
        n = 0
        for f in files:
            if not self._present(f):
                self._require_dir()
                break
            n += 1
        return n

    def batch_contains(self, keys: list[str]) -> list[bool]:
        files = self._files(keys)
        self._count(exists_calls=1)
        found = [self._present(f) for f in files]
        if not all(found):
            self._require_dir()
        return found

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        out = []
        for f in self._files(keys):
            self._count(gets=1)
            try:
                with open(f, "rb") as fh:
                    data = fh.read()
            except FileNotFoundError:
                out.append(None)
                continue
            except OSError as e:
                self._require_dir(e)
                self._count(errors=1)
                self.failure_log.failure("failed reads", "reading %s failed: %s", f, e)
                out.append(None)
                continue
            self._count(hits=1, bytes_read=len(data))
            out.append(data)
        return out

    def batch_set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        files = self._files(keys)
        for v in values:   # before any I/O, like the keys: no temporary left behind
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise TypeError(f"file backend stores bytes, got {type(v).__name__}")
        return [self._set(k, f, v) for k, f, v in zip(keys, files, values)]

    def _set(self, key: str, f: str, value: bytes) -> bool:
        tmp = os.path.join(self.path, f".{key[:16]}.{uuid.uuid4().hex}.tmp")
        self._count(sets=1)
        try:
            self._write(tmp, value)
            os.replace(tmp, f)
        except OSError as e:  # disk full, quota, permissions: this key is not stored
            self._count(set_failures=1)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._require_dir(e)
            self.failure_log.failure("failed sets", "storing %s failed: %s", key, e)
            return False
        self._count(bytes_written=memoryview(value).nbytes)
        return True

    def _write(self, tmp: str, value: bytes) -> None:
        with open(tmp, "wb") as fh:
            fh.write(value)
            if self.fsync:
                fh.flush()
                os.fsync(fh.fileno())

    def delete(self, key: str) -> bool:
        f = self._file(key)
        self._count(deletes=1)
        try:
            os.unlink(f)
            return True
        except FileNotFoundError:
            self._require_dir()
            return False
        except OSError as e:   # read-only, permissions: not removed
            self._require_dir(e)
            self._count(errors=1)
            self.failure_log.failure("failed deletes", "removing %s failed: %s", f, e)
            return False

    def clear(self) -> None:
        """Remove every key-named file (and leftover temporaries); nothing else."""
        try:
            names = os.listdir(self.path)
        except OSError as e:
            self._count(errors=1)
            raise StorageUnavailable(f"file backend: cannot list directory {self.path}: {e}") from e
        for name in names:
            temporary = name.startswith(".") and name.endswith(".tmp")
            if not (temporary or KEY_RE.match(name)):
                continue
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass
            except OSError as e:
                self._require_dir(e)
                self._count(errors=1)
                self.failure_log.failure("failed deletes", "removing %s failed: %s", name, e)

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counters)
        return dict(out, backend=self.name, path=self.path)

    def close(self) -> None:
        """Nothing to release; say what failed since the last warning."""
        self.failure_log.flush()

    def __repr__(self) -> str:
        return f"FileBackend(path={self.path!r})"


def _check_writable_dir(path: str) -> None:
    """Create `path` if missing and write a probe file there: a path under a regular
    file, or a read-only one, is a configuration error (ValueError) at start-up, not a
    failure per key later."""
    what = f"file backend: the 'path' setting {path!r} must be a writable directory"
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{what}; it is a file")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{what}; cannot create it: {e.strerror or e}") from None
    probe = os.path.join(path, f".probe.{uuid.uuid4().hex}.tmp")
    try:
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{what}; cannot write there: {e.strerror or e}") from None
