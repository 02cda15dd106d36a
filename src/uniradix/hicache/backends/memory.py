"""An L3 store held in this process's memory, unbounded: what `uniradix simulate`
replays an L3 on (accounting-only pools write empty pages, so it holds only the
objects' headers). Not a serving backend: it is shared by no one and gone at exit."""
from __future__ import annotations

import threading

from ..storage import StorageBackend, check_key


class MemoryBackend(StorageBackend):
    name = "memory"

    def __init__(self) -> None:
        self._d: dict[str, bytes] = {}
        self._lock = threading.Lock()  # the tier's I/O threads call in concurrently

    def batch_exists(self, keys: list[str]) -> int:
        with self._lock:
            n = 0
            while n < len(keys) and check_key(keys[n]) and keys[n] in self._d:
                n += 1
            return n

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        for k in keys:
            check_key(k)
        with self._lock:
            return [self._d.get(k) for k in keys]

    def batch_set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        for k in keys:
            check_key(k)
        with self._lock:
            self._d.update(zip(keys, map(bytes, values)))
        return [True] * len(keys)

    def set_if_absent(self, key: str, value: bytes) -> bool:
        check_key(key)
        with self._lock:
            if key in self._d:
                return False
            self._d[key] = bytes(value)
            return True

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return self._d.pop(key, None) is not None

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __len__(self) -> int:
        return len(self._d)
