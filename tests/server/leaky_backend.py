"""A user storage backend (for `--hicache-storage-backend dynamic`) as careless as one
can be: it echoes its URL and settings in a log line at start-up and in every error it
raises. Whatever it prints, the server must show no secret of them."""
import logging
import os

from uniradix.hicache.storage import StorageBackend, StorageUnavailable

log = logging.getLogger("leaky_backend")


class LeakyBackend(StorageBackend):
    """Never reachable: every call raises StorageUnavailable naming the URL;
    `fail_start`: the constructor raises too; `native_echo`: it also writes its URL
    straight to file descriptor 2, as a native client library does (Mooncake's logs its
    metadata server's URL), where no log filter sees it."""

    name = "leaky"

    def __init__(self, url: str, fail_start: bool = False, native_echo: bool = False, **settings) -> None:
        self.url = url
        log.warning("leaky backend: connecting to %s with %s", url, settings)
        if native_echo:
            os.write(2, f"E1201 transfer_metadata_plugin.cpp:340] PUT {url} failed\n".encode())
        if fail_start:
            raise ConnectionError(f"cannot reach {url} (settings {settings})")

    def _down(self):
        raise StorageUnavailable(f"leaky backend: {self.url} is unreachable")

    def batch_exists(self, keys):
        self._down()

    def batch_get(self, keys):
        self._down()

    def batch_set(self, keys, values):
        self._down()

    def delete(self, key):
        self._down()

    def clear(self):
        self._down()

    def stats(self):
        return {"errors": 0, "url": self.url}
