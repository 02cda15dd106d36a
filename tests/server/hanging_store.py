"""A storage backend for the server tests (loaded by name through the dynamic backend):
a file store whose reads never return, as a store that stopped answering would."""
import threading

from uniradix.hicache.backends.file import FileBackend


class HangingStore(FileBackend):
    """Every read blocks for good (until the process ends)."""

    _never = threading.Event()

    def batch_get(self, keys):
        self._never.wait()
        return super().batch_get(keys)

    def batch_exists(self, keys):
        self._never.wait()
        return super().batch_exists(keys)

    def batch_contains(self, keys):
        self._never.wait()
        return super().batch_contains(keys)
