"""The witness of a namespace's weights.

Engines share L3 data when their namespaces agree. By default the namespace names the
weights (a digest of the checkpoint), but a fleet may name its model itself
(`model_fingerprint`), and then nothing in the name says which weights computed the
stored KV: two servers given one name and different weights would read each other's
pages and answer wrongly. So the namespace also holds a witness of the model
(model.fingerprint.model_witness: a digest of its computation, the config as read,
and of its loaded tensors, every byte of them under a fleet's own name) under a key of
its own, in the checked object format.

Before an engine's first read or write, again every RECHECK_S seconds, after the store
failed, after the backend reconnected (its `generation` changed), and after a write
found objects it believed stored gone (the store was emptied), the witness is read:
absent, this engine's is written (set-if-absent, then read back: of two engines
starting at once, one wins and the other sees it);
equal, the namespace is trusted; different, L3 is refused to this engine for good (no
reads, no writes; one error in the log naming the namespace and both witnesses; a
metric). A refused engine computes what it would have read: its answers stay its own.
All of it runs on the storage tier's I/O threads, never at start-up or on the
scheduler's thread, so a store that is down delays nothing (the check is tried again
at the next call).

The witness key says who owns a name; it is not what keeps answers right. A store can
lose that one key and keep the objects (an LRU policy evicts it, a clean-up by age
removes it, the store is emptied and claimed by other weights between two checks), and
other weights would then claim the name. So the objects themselves are bound to the
witness too (l3.bound_namespace: it is part of their keys and headers): other weights
never find them, whatever happens to the witness key."""
from __future__ import annotations

import hashlib
import logging
import threading
import time

from .keys import StorageNamespace, witness_key
from .objects import NEWER, CorruptObject, object_nbytes_at_most, pack_object, unpack_object
from .storage import StorageBackend, StorageUnavailable

log = logging.getLogger("uniradix.hicache")

#: seconds an agreement holds before the witness is read again (a store that was emptied
#: and claimed by other weights meanwhile is noticed within this)
RECHECK_S = 10.0
#: bytes a witness may have at most (one is a digest's hex: 64)
WITNESS_MAX = 1024


class Witness:
    """backend: the store; namespace: the tier's (without salt); mine: this engine's
    witness of its weights; secret: the objects' MAC key (or None)."""

    def __init__(self, backend: StorageBackend, namespace: StorageNamespace, mine: str,
                 secret: bytes | None = None, recheck_s: float = RECHECK_S) -> None:
        if not isinstance(mine, str) or not mine or len(mine.encode()) > WITNESS_MAX:
            raise ValueError(f"the weights' witness must be a non-empty string of at most {WITNESS_MAX} "
                             f"bytes, got {mine!r:.40}")
        self.backend = backend
        self.namespace = namespace
        self.mine = mine
        self.secret = secret
        self.key = witness_key(namespace, secret)
        backend.expect_values_up_to(object_nbytes_at_most(WITNESS_MAX))
        self.seed = namespace.seed()
        self.recheck_s = recheck_s
        self.theirs: str | None = None   # the other witness, once one was found
        self.refused = False
        self.mismatches = 0
        self._agreed_at: float | None = None
        self._generation = None   # the backend's generation when the agreement was made
        self._lock = threading.Lock()

    def allows(self) -> bool:
        """Whether this engine may read and write the namespace now (an I/O thread asks
        before each read or write). StorageUnavailable when the store cannot say: that
        call fails like any other, and the next one asks again."""
        if self.refused:
            return False
        with self._lock:
            if self.refused:
                return False
            if (self._agreed_at is not None and time.monotonic() - self._agreed_at < self.recheck_s
                    and getattr(self.backend, "generation", None) == self._generation):
                return True
            self._check()
            return not self.refused

    def forget(self) -> None:
        """The store failed: what was agreed is read again before the next call."""
        self._agreed_at = None

    def _check(self) -> None:
        generation = getattr(self.backend, "generation", None)
        theirs = self._read()
        if theirs is None:
            self.backend.set_if_absent(self.key, pack_object(self.key, self.mine.encode(), self.seed, self.secret))
            theirs = self._read()   # whoever won the race
            if theirs is None:
                raise StorageUnavailable(f"the witness of namespace {label(self.namespace)} could not be "
                                         f"stored (key {self.key[:16]}...)")
        if theirs == self.mine:
            self._agreed_at, self._generation = time.monotonic(), generation
            return
        self.refused, self.theirs = True, theirs
        self.mismatches += 1
        log.error("L3 refused: namespace %s holds the witness %s of another model, and this engine's "
                  "model gives %s. Different weights or configs (or one checkpoint loaded at another dtype "
                  "or quantization) share one namespace: give each its own model_fingerprint (or remove the "
                  "store key %s once the other model is gone). "
                  "This engine serves without L3; its answers are its own.",
                  label(self.namespace), theirs, self.mine, self.key)

    def _read(self) -> str | None:
        """The stored witness; None when absent. A damaged one is removed (a sound one
        replaces it); one in a newer format than this build reads is a StorageUnavailable."""
        data = self.backend.batch_get([self.key])[0]
        if data is None:
            return None
        try:
            return unpack_object(data, self.key, self.seed, self.secret).decode("ascii")
        except (CorruptObject, UnicodeDecodeError) as e:
            if getattr(e, "kind", None) == NEWER:   # a newer server's: not checkable here, not ours to replace
                raise StorageUnavailable(f"the witness of namespace {label(self.namespace)} is in a newer format "
                                         f"than this build reads ({e.reason}): upgrade this server") from None
            log.warning("L3: the witness of namespace %s is unusable (%s): replaced", label(self.namespace),
                        getattr(e, "reason", e))
            self.backend.delete(self.key)
            return None

    @property
    def state(self) -> str:
        return "refused" if self.refused else "unchecked" if self._agreed_at is None else "trusted"


def label(ns: StorageNamespace) -> str:
    """A namespace as a log line names it: the model's name as given (a config's text
    is long: its digest instead), page size and rank."""
    model = ns.model if len(ns.model) <= 80 else f"config {hashlib.sha256(ns.model.encode()).hexdigest()[:16]}"
    return f"{model!r} (page size {ns.page_size}, rank {ns.rank})"
