"""A cache's pages and checkpoints in L3: which keys they go under, how deep a prefix
the store can serve (the deepest boundary every component accepts), and all-or-nothing
save and load through the checked object format.

Keys: FULL page i under the chained page key k_i; a SWA page under k_i + ".swa"; a
MAMBA checkpoint at position (i+1)*P under k_i + ".mamba"; a sidecar's row under the
component's key with "_<sidecar>" added to the suffix (".full_scales" for FULL). A
component whose pool holds no tensors (the FULL pool of a model with no full-attention
layer only counts pages) stores empty objects: they mark the page as present, so every
mix of layers goes through L3 the same way.

Saving is split so that no store I/O runs on the scheduler's thread: `prepare_*` reads
the tree and the pools (the scheduler's thread, which owns them) and returns a
`SaveJob` of payloads; `commit` asks the store which keys it lacks (one batched call)
and writes those (any thread). What a write sends is what a reader needs to resume
(store_writes.py).

Keys this store has seen written or present are remembered (a bounded set), so a
conversation's earlier turns are not read from the pools again. That memory is a cache
of the store, not the truth: a write re-checks the keys it skips in its one membership
call, a read that finds fewer objects than believed, a failed call and a backend that
reconnected (its `generation` changed) forget them, and a belief expires after
`known_ttl` seconds; a key forgotten is written again at its path's next write. A read
that finds an object damaged, forged or from another format deletes it at once, so the
recomputed data replaces it at the next write."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from .codec import handle_nbytes, sidecar_row_nbytes, write_handles, write_sidecar_rows
from .keys import StorageNamespace, component_key, page_keys
from .log_limit import LogLimiter
from .objects import NO_WRITER, CorruptObject, object_nbytes_at_most, unpack_with_writer
from .storage import StorageBackend
from .store_writes import BUSY, KNOWN, MINE, Writing

log = logging.getLogger("uniradix.hicache")


#: keys remembered as present in the store (about 40 bytes each)
KNOWN_KEYS = 1 << 18
#: seconds a key stays believed stored without the store confirming it again
KNOWN_TTL_S = 600.0


@dataclass
class Fetched:
    """Checked objects for a load to [start, b), not yet written to the pools.
    `cross_instance`: the tokens of [start, b) whose pages another instance wrote (by
    the writer their page objects name)."""

    b: int
    start: int
    plan: list
    blobs: list
    objects: int
    nbytes: int = 0
    cross_instance: int = 0


class L3Store(Writing):
    """cache: a UnifiedRadixCache (its components, pools and page size); backend: the
    StorageBackend; namespace: a StorageNamespace without salt (the salt of each call
    is added to it); secret: the key of the objects' MAC (objects.resolve_secret), or
    None for plain checksums; writer: this instance's 16-byte id, written into every
    object (a read tells its own objects from another instance's by it)."""

    def __init__(self, cache, backend: StorageBackend, namespace: StorageNamespace,
                 secret: bytes | None = None, known_keys: int = KNOWN_KEYS,
                 known_ttl: float = KNOWN_TTL_S, writer: bytes = NO_WRITER) -> None:
        if namespace.page_size != cache.page_size:
            raise ValueError(f"namespace page size {namespace.page_size} != cache page size {cache.page_size}")
        self.cache = cache
        self.backend = backend
        self.namespace = namespace
        self.secret = secret
        self.writer = writer
        self.P = cache.page_size
        self.comps = cache.page_comps
        self.ckpt = cache.ckpt
        self.counters = dict(saved_objects=0, saved_bytes=0, loaded_objects=0, loaded_bytes=0, corrupt=0,
                             unauthenticated=0, deleted=0, failed_sets=0, errors=0, loads=0, failed_loads=0,
                             lost=0)  # lost: believed stored, found missing (written again)
        # the reads of loads, whatever became of them: backend.batch_get calls, the objects
        # they asked for, the bytes they returned (headers included) and their wall
        # seconds; fetch_s: the whole read of a load (keys, batch_get, checks; not the hit)
        self.counters.update(get_calls=0, get_objects=0, get_bytes=0, get_s=0.0, fetch_s=0.0)
        self._lock = threading.Lock()
        self._known: OrderedDict = OrderedDict()  # hash(key) -> when the store last confirmed it
        self._known_max = known_keys
        self._known_ttl = known_ttl
        self._queued: set = set()  # hash(key) of keys a prepared job will write: no other job reads them
        self._generation = getattr(backend, "generation", None)
        self._sizes: dict = {}  # bytes per handle of each pool and sidecar, by id
        self._warn = LogLimiter(log, "L3")
        # no object this store reads is larger than its largest handle's: a bigger entry
        # under one of its keys is not read into memory (StorageBackend.expect_values_up_to)
        largest = max([handle_nbytes(p) for p in cache.pools]
                      + [sidecar_row_nbytes(sc) for p in cache.pools for sc in getattr(p, "sidecars", {}).values()])
        backend.expect_values_up_to(object_nbytes_at_most(largest))

    # ------------------------------------------------------------------ keys
    def _ns(self, salt) -> StorageNamespace:
        n = self.namespace
        return n if salt is None else n.with_salt(salt)

    def _key(self, page_key: str, c) -> str:
        return page_key if c.structural else component_key(page_key, c.name)

    def _sidecar_keys(self, pool, c, keys):
        out = []
        for sc in getattr(pool, "sidecars", {}).values():
            out.append((sc, [component_key(k, f"{c.name}_{sc.name}") for k in keys]))
        return out

    # ------------------------------------------------------------------ beliefs
    def _is_known(self, key: str) -> bool:
        """Believed stored: confirmed by the store (written, found present or read) less
        than `known_ttl` seconds ago and not contradicted since."""
        h = hash(key)
        with self._lock:
            t = self._known.get(h)
            if t is None:
                return False
            if time.monotonic() - t > self._known_ttl:
                del self._known[h]
                return False
            self._known.move_to_end(h)
            return True

    def _claim(self, key: str) -> str:
        """What a write does with `key`: KNOWN (believed stored: skip it, re-check it),
        BUSY (a job already prepared writes it), or MINE (the caller's job writes it; no
        other job reads it until `_release`)."""
        if self._is_known(key):
            return KNOWN
        h = hash(key)
        with self._lock:
            if h in self._queued:
                return BUSY
            self._queued.add(h)
        return MINE

    def _release(self, hashes) -> None:
        """A prepared job ended (committed, failed or dropped): its keys may be claimed again."""
        if hashes:
            with self._lock:
                self._queued.difference_update(hashes)

    def _remember(self, keys) -> None:
        now = time.monotonic()
        with self._lock:
            known = self._known
            for k in keys:
                h = hash(k)
                known[h] = now
                known.move_to_end(h)
            while len(known) > self._known_max:
                known.popitem(last=False)

    def _forget(self, keys) -> None:
        with self._lock:
            for k in keys:
                self._known.pop(hash(k), None)

    def _forget_pages(self, keys: list) -> None:
        """The store lacks these pages (a read found them absent): forget every object
        believed stored under their page keys, each component's and the checkpoint's."""
        if not keys:
            return
        names = [c.name for c in self.comps if not c.structural]
        if self.ckpt is not None:
            names.append(self.ckpt.name)
        self._forget([k for pk in keys for k in (pk, *(component_key(pk, n) for n in names))])

    def forget_all(self) -> None:
        """Believe nothing stored any more (the store failed or reconnected: it may have
        lost anything)."""
        with self._lock:
            self._known.clear()

    def _check_generation(self) -> None:
        """A backend that reconnected (or learnt that its store restarted) bumps its
        `generation`: what was believed before may be gone."""
        g = getattr(self.backend, "generation", None)
        if g != self._generation:
            self._generation = g
            self.forget_all()

    # ------------------------------------------------------------------ hit
    def hit(self, tokens, salt=None) -> int:
        """The deepest page-aligned boundary b such that the store has FULL pages of
        [0, b), the SWA pages of the window before b, and a MAMBA checkpoint at b."""
        return self._reading(self._hit, page_keys(tokens, self._ns(salt)))

    def _reading(self, fn, *args):
        """Run a read. One that fails (the store unreachable, a backend error) may mean
        the store lost anything: nothing is believed stored after it."""
        self._check_generation()
        try:
            return fn(*args)
        except Exception:
            self.forget_all()
            raise

    def _hit(self, keys: list[str]) -> int:
        b_pages = self.backend.batch_exists(keys)
        self._forget_pages(keys[b_pages:])  # absent: whatever was believed of them is wrong
        while b_pages > 0:
            b = b_pages * self.P
            if self._accepts(keys, b):
                return b
            b_pages -= 1
        return 0

    def _accepts(self, keys, b: int) -> bool:
        P = self.P
        for c in self.comps:
            if c.structural:  # its leading run is what batch_exists counted
                continue
            lo = c.window_start(b) // P
            ks = [self._key(k, c) for k in keys[lo:b // P]]
            n = self.backend.batch_exists(ks)
            if n != len(ks):
                self._forget(ks[n:])
                return False
        if self.ckpt is not None:
            k = component_key(keys[b // P - 1], self.ckpt.name)
            if self.backend.batch_exists([k]) != 1:
                self._forget([k])
                return False
        return True

    # ------------------------------------------------------------------ save

    # ------------------------------------------------------------------ load
    def load(self, tokens, b: int, pages: dict, state_slot: int | None = None, salt=None,
             start: int = 0) -> bool:
        """Read what a request resuming at b needs (FULL pages of [0, b), SWA pages of the
        window before b, the MAMBA checkpoint at b) into the handles given in
        `pages[name]` (one per page; only the window's entries are used for SWA) and
        `state_slot`; pages below `start` (page-aligned: what the device already holds)
        are skipped. All or nothing: a missing or bad object writes nothing and returns
        False (bad ones are counted and deleted)."""
        got = self.fetch(tokens, b, pages, state_slot, salt, start)
        if got is None:
            return False
        self.apply(got)
        return True

    def prefetch(self, tokens, start: int, pages: dict, state_slot: int | None, salt=None,
                 threshold: int = 1) -> "Fetched | None":
        """The I/O half of a load, safe to run on a background thread: find the store's
        hit and, when it passes `start` by at least `threshold` tokens, read and check
        everything from `start` to it. Nothing is written to the pools (see apply)."""
        return self._reading(self._prefetch, tokens, start, pages, state_slot, salt, threshold)

    def _prefetch(self, tokens, start, pages, state_slot, salt, threshold):
        keys = page_keys(tokens, self._ns(salt))  # hashed once for the hit and the read
        h = self._hit(keys)
        if h - start < max(threshold, 1):
            return None
        return self._fetch(tokens, h, pages, state_slot, salt, start, keys[:h // self.P], later=True)

    def fetch(self, tokens, b: int, pages: dict, state_slot: int | None = None, salt=None,
              start: int = 0, keys: list[str] | None = None) -> "Fetched | None":
        """Read and check the objects `load` would write; None when one is missing or bad
        (then nothing of it is believed stored any more). `keys`: the page keys of
        tokens[:b], when the caller has them."""
        return self._reading(self._fetch, tokens, b, pages, state_slot, salt, start, keys)

    def _fetch(self, tokens, b, pages, state_slot, salt, start, keys, later: bool = False):
        """`later`: a windowed component's pages past the end of `pages[name]` are not
        taken yet (a request takes the window only once it knows where it resumes): -1
        in the plan until `bind` gives them the request's handles."""
        if b % self.P or start % self.P:
            raise ValueError(f"boundary {b} and start {start} must be page-aligned ({self.P})")
        self._count("loads")
        t0 = time.perf_counter()
        try:
            return self._read_objects(tokens, b, pages, state_slot, salt, start, keys, later)
        finally:
            self._count("fetch_s", time.perf_counter() - t0)

    def _read_objects(self, tokens, b, pages, state_slot, salt, start, keys, later):
        ns = self._ns(salt)
        seed = ns.seed()
        if keys is None:
            keys = page_keys(tokens[:b], ns)
        if len(keys) * self.P != b:
            raise ValueError(f"{len(tokens)} tokens cannot resume at {b}")
        plan = []  # (pool or sidecar, handles, keys, is_sidecar)
        pages_of = None  # the plan entry of the structural component's pages: their writers count
        for c in self.comps:
            pool = self.cache.pools[c.index]
            lo = max(c.window_start(b), start) // self.P
            hs = list(pages[c.name][lo:b // self.P])
            missing = b // self.P - lo - len(hs)
            if min(hs, default=0) < 0 or missing and not (later and c.window is not None):
                raise ValueError(f"{c.name}: need handles for pages [{lo}, {b // self.P})")
            hs += [-1] * missing  # pages a request takes once it knows where it resumes: see bind
            if not hs:
                continue  # nothing of it to read at b (a window of one token reads none)
            page_ks = keys[lo:]
            if c.structural:
                pages_of = len(plan)
            plan.append((pool, hs, [self._key(k, c) for k in page_ks], False))
            for sc, sks in self._sidecar_keys(pool, c, page_ks):
                plan.append((sc, hs, sks, True))
        if self.ckpt is not None and b > 0:
            if state_slot is None:
                raise ValueError("a model with recurrent layers needs a state slot to load into")
            plan.append((self.cache.pools[self.ckpt.index], [state_slot],
                         [component_key(keys[-1], self.ckpt.name)], False))
        all_keys = [k for _, _, ks, _ in plan for k in ks]
        t0 = time.perf_counter()
        data = self.backend.batch_get(all_keys)
        got_s = time.perf_counter() - t0
        with self._lock:
            c = self.counters
            c["get_calls"] += 1
            c["get_objects"] += len(all_keys)
            c["get_bytes"] += sum(len(d) for d in data if d is not None)
            c["get_s"] += got_s
        blobs, bad, absent, i, foreign = [], [], [], 0, 0
        for j, (target, _, ks, sidecar) in enumerate(plan):
            n = sidecar_row_nbytes(target) if sidecar else handle_nbytes(target)
            got = []
            for k, d in zip(ks, data[i:i + len(ks)]):
                try:
                    x, writer = unpack_with_writer(d, k, seed, self.secret)
                    if j == pages_of and (writer or NO_WRITER) != self.writer:
                        foreign += 1
                except CorruptObject as e:
                    if e.kind in ("absent", "newer"):   # a newer server's object: not ours to delete
                        absent.append(k)
                    else:
                        bad.append((k, e))
                    continue
                if len(x) != n:  # a sound object from a differently shaped pool
                    bad.append((k, CorruptObject(k, f"payload of {len(x)} bytes, the pool holds {n}")))
                    continue
                got.append(x)
            blobs.append(got)
            i += len(ks)
        if bad or absent:
            self._forget(all_keys)  # a failed read: what it covers is re-checked before it is skipped again
            self._drop(bad)
            self._count("failed_loads")
            return None
        self._remember(all_keys)
        return Fetched(b, start, plan, blobs, len(all_keys), sum(len(x) for bl in blobs for x in bl),
                       foreign * self.P)

    def _drop(self, bad: list) -> None:
        """Objects found unusable at read time are counted and deleted at once: the
        request computes what they held, and its write-through stores it afresh (a
        write never replaces a key the store still has)."""
        if not bad:
            return
        self._forget(k for k, _ in bad)
        for k, e in bad:
            self._count("unauthenticated" if e.kind == "unauthenticated" else "corrupt")
            self._warn.failure("unusable objects deleted", "object %s is unusable (%s): deleted",
                               k[:16], e.reason)
            try:
                if self.backend.delete(k):
                    self._count("deleted")
            except Exception as err:  # a store that refuses the delete keeps a bad object: a miss each time
                self._count("errors")
                self._warn.failure("failed deletes", "could not delete unusable object %s: %s", k[:16], err)

    def bind(self, got: "Fetched", pages: dict) -> None:
        """Give the windowed pages a prefetch read before they were taken (-1 in its plan)
        the request's handles, `pages[name]` now holding the window before `got.b`. A
        sidecar's rows share their pool entry's list, so they follow."""
        P = self.P
        for target, hs, _, sidecar in got.plan:
            if sidecar or min(hs, default=0) >= 0:
                continue
            c = next(c for c in self.comps if self.cache.pools[c.index] is target)
            own = list(pages[c.name][got.b // P - len(hs):got.b // P])
            if len(own) != len(hs) or min(own) < 0:
                raise ValueError(f"{c.name}: need handles for the {len(hs)} pages before {got.b}")
            hs[:] = own

    def apply(self, got: "Fetched") -> None:
        """Write fetched data into the pools (on the thread that owns them)."""
        for (target, hs, _, sidecar), bl in zip(got.plan, got.blobs):
            (write_sidecar_rows if sidecar else write_handles)(target, hs, bl)
        self.count_applied(got)

    def count_applied(self, got: "Fetched") -> None:
        """`got` was written to the pools (here, or through the host tier by the cache)."""
        self._count("loaded_objects", got.objects)
        self._count("loaded_bytes", got.nbytes)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def stats(self) -> dict:
        return dict(self.counters, backend=self.backend.stats())

    def close(self) -> None:
        """Log the failures not yet reported; jobs never committed hold nothing back."""
        with self._lock:
            self._queued.clear()
        self._warn.flush()
