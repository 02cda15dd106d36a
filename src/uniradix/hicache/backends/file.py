"""The file backend: one file per key in a directory. Writes go to a temporary file in
the same directory and are renamed into place, so a reader sees a whole object or
none, even with several engines writing the same key."""
from __future__ import annotations

import logging
import os
import uuid

from ..storage import KEY_RE, StorageBackend, StorageUnavailable, check_key

log = logging.getLogger("uniradix.hicache")

DEFAULT_DIR = "/tmp/hicache"


class FileBackend(StorageBackend):
    """`path`: the directory (created if missing). `fsync`: flush each object to disk
    before the rename (durable across a crash, slower)."""

    name = "file"

    def __init__(self, path: str = DEFAULT_DIR, fsync: bool = False) -> None:
        self.path = os.path.abspath(path)
        self.fsync = bool(fsync)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise StorageUnavailable(f"file backend: cannot use directory {self.path}: {e}") from e
        log.warning("file backend at %s: a node-local directory is not shared between machines "
                    "unless it is a shared mount (NFS, Lustre, ...)", self.path)
        self.counters = dict(gets=0, hits=0, sets=0, set_failures=0, errors=0, bytes_written=0,
                             bytes_read=0)

    def _file(self, key: str) -> str:
        return os.path.join(self.path, check_key(key))

    def _files(self, keys: list[str]) -> list[str]:
        """Every key checked before any I/O: a bad key in a batch touches nothing."""
        return [self._file(k) for k in keys]

    def batch_exists(self, keys: list[str]) -> int:
        n = 0
        for f in self._files(keys):
            if not os.path.exists(f):
                break
            n += 1
        return n

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        out = []
        for f in self._files(keys):
            self.counters["gets"] += 1
            try:
                with open(f, "rb") as fh:
                    data = fh.read()
            except FileNotFoundError:
                out.append(None)
                continue
            except OSError as e:
                self.counters["errors"] += 1
                if not os.path.isdir(self.path):
                    raise StorageUnavailable(f"file backend: directory {self.path} is gone") from e
                log.warning("file backend: reading %s failed: %s", f, e)
                out.append(None)
                continue
            self.counters["hits"] += 1
            self.counters["bytes_read"] += len(data)
            out.append(data)
        return out

    def batch_set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        files = self._files(keys)
        return [self._set(k, f, v) for k, f, v in zip(keys, files, values)]

    def _set(self, key: str, f: str, value: bytes) -> bool:
        tmp = os.path.join(self.path, f".{key[:16]}.{uuid.uuid4().hex}.tmp")
        self.counters["sets"] += 1
        try:
            self._write(tmp, value)
            os.replace(tmp, f)
        except OSError as e:  # disk full, quota, permissions: this key is not stored
            self.counters["set_failures"] += 1
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if not os.path.isdir(self.path):
                self.counters["errors"] += 1
                raise StorageUnavailable(f"file backend: directory {self.path} is gone") from e
            log.warning("file backend: storing %s failed: %s", key, e)
            return False
        self.counters["bytes_written"] += len(value)
        return True

    def _write(self, tmp: str, value: bytes) -> None:
        with open(tmp, "wb") as fh:
            fh.write(value)
            if self.fsync:
                fh.flush()
                os.fsync(fh.fileno())

    def delete(self, key: str) -> bool:
        try:
            os.unlink(self._file(key))
            return True
        except FileNotFoundError:
            return False

    def clear(self) -> None:
        """Remove every key-named file (and leftover temporaries); nothing else."""
        for name in os.listdir(self.path):
            temporary = name.startswith(".") and name.endswith(".tmp")
            if not (temporary or KEY_RE.match(name)):
                continue
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass

    def stats(self) -> dict:
        return dict(self.counters, backend=self.name, path=self.path)
