"""A storage backend for the server tests (loaded by name through the dynamic backend):
a file store whose reads never return, as a store that stopped answering would."""
import threading

from uniradix.hicache.backends.file import FileBackend
from uniradix.hicache.storage import PROBE_KEY


class HangingStore(FileBackend):
    """Every read blocks for good (until the process ends), once the server is up: it
    answered the start-up's probe, and stopped answering after."""

    _never = threading.Event()

    def probe(self):
        FileBackend.batch_exists(self, [PROBE_KEY])

    def batch_get(self, keys):
        self._never.wait()
        return super().batch_get(keys)

    def batch_exists(self, keys):
        self._never.wait()
        return super().batch_exists(keys)

    def batch_contains(self, keys):
        self._never.wait()
        return super().batch_contains(keys)


class HangingClose(FileBackend):
    """A file store that works, but whose close() never returns (a client that waits on
    a store that stopped answering, as Mooncake's does at its teardown)."""

    _never = threading.Event()

    def close(self):
        self._never.wait()


class RefusingWrites(FileBackend):
    """A file store that reads, but refuses every write of data (a full disk): only the
    namespace's witness goes in."""

    def batch_set(self, keys, values):
        ok = [k.endswith(".witness") for k in keys]
        super().batch_set([k for k, good in zip(keys, ok) if good], [v for v, good in zip(values, ok) if good])
        return ok
