"""The storage tier (L3): one owner for shared storage. It names the data (the
namespace: the model, its weights' fingerprint, page size, rank, and each request's
salt; a secret for the objects' MAC), reads prefixes a request could resume from deeper
than the device allows (on I/O threads, waiting as the prefetch policy says), writes
finished work through (the pools read on the scheduler's thread, the store asked and
written on an I/O thread), and takes what the host tier is about to lose (write_back).
A store that fails costs only reuse: the request computes, the error is counted.

Before it reads or writes, the tier checks the namespace's witness of the weights
(witness.py): a store whose namespace holds other weights' witness is refused for good.
The objects' keys and headers also carry what decides whether a reader may use them
(`bound_namespace`): the witness, so that other weights' objects (or the same
checkpoint's at another dtype) stay unreadable even when the witness key is lost, and a
digest of the MAC secret, so that engines with other secrets never meet (nor delete)
each other's objects.

Nothing here waits on the store without a deadline: the I/O threads are daemon threads
(io_threads.py), a read waits at most `io_timeout` (wait_complete included: the request
waits, the scheduler goes on), a flush or close waits for pending writes at most its
timeout, and reads stuck in a store that stopped answering make the next requests
compute at once instead of queueing behind them."""
from __future__ import annotations

import hashlib
import logging
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import replace

from .instances import ALONE_S, Instances
from .io_threads import DaemonThreads
from .keys import StorageNamespace
from .log_limit import LogLimiter
from .objects import resolve_secret
from .storage import StorageUnavailable
from .store import L3Store
from .witness import Witness

log = logging.getLogger("uniradix.hicache")

#: writes queued on the I/O thread beyond which new ones are dropped (and counted)
MAX_PENDING_WRITES = 256
#: I/O threads for reads (prefetches run side by side) and for writes (in order)
READ_THREADS, WRITE_THREADS = 2, 1
#: the longest the scheduler sleeps in wait() before it looks at its inbox again
WAIT_SLICE_S = 0.05
#: payload bytes a flush or a shutdown reads from the pools at a time (write_down)
WRITE_DOWN_CHUNK = 64 << 20


def bound_namespace(ns: StorageNamespace, witness: str | None, secret: bytes | None) -> StorageNamespace:
    """The namespace the objects go under: `ns` bound to what decides whether a reader
    may use them, so that every key and object header carries it and a reader that
    could not use an object never finds it.

    - The weights' witness (the loaded tensors' values and dtypes): a fleet's
      model_fingerprint says nothing of the weights, and a checkpoint's fingerprint
      nothing of the dtype it was loaded at (float16 and bfloat16 pages have one size),
      so no object computed by other weights is ever read, whatever becomes of the
      witness key (evicted by an LRU store, removed, the store emptied and claimed by
      other weights before this engine looks again). The witness key stays under the
      unbound name, where engines sharing a name meet (witness.py).
    - A digest of the MAC secret: engines with another secret (a fleet mid-rotation) or
      none use other keys, instead of each deleting the other's objects as forged."""
    parts = []
    if witness is not None:
        parts.append(f"witness:{witness}")
    if secret:
        parts.append("keyed:" + hashlib.blake2b(secret, digest_size=16, person=b"urx-l3-keys").hexdigest())
    return replace(ns, binding=" ".join(parts)) if parts else ns


def _wait_until(fut, deadline: float) -> bool:
    """Wait for a future until a time.monotonic() deadline; True when it is done."""
    wait([fut], timeout=max(0.0, deadline - time.monotonic()))
    return fut.done()


class StorageTier:
    """cache: the UnifiedRadixCache whose pools it reads and fills; backend: a
    StorageBackend (the caller's: close it yourself); settings: a config.StorageConfig;
    write_policy, write_min_hits: the host tier's policy (write_back: only what the host
    evicts goes down); weights: the weights' fingerprint (ignored when the settings name
    the model themselves); witness: model.fingerprint.model_witness of the model,
    checked against the namespace's before any read or write (None: not checked)."""

    def __init__(self, cache, backend, settings, model, *, weights: str = "", write_policy: str = "write_through",
                 write_min_hits: int = 0, witness: str | None = None) -> None:
        self.cache = cache
        self.settings = settings
        self.policy = settings.hicache_storage_prefetch_policy
        self.threshold = max(settings.prefetch_threshold, 1)
        if settings.model_fingerprint is not None:  # the fleet names the model (and its weights) itself
            ns = StorageNamespace.for_model(settings.model_fingerprint, cache.page_size, settings.rank)
        else:
            ns = StorageNamespace.for_model(model, cache.page_size, settings.rank, weights=weights)
        secret = resolve_secret(settings.auth_secret)
        self.namespace, self.secret = ns, secret
        self.witness = None if witness is None else Witness(backend, ns, witness, secret)
        # this instance, as the objects it writes and its announcement name it
        self.instance_id = uuid.uuid4().bytes
        self.store = L3Store(cache, backend, bound_namespace(ns, witness, secret), secret, writer=self.instance_id)
        self.instances = None  # instances.Instances, once announce() starts it
        self.io_timeout = settings.io_timeout
        self._warn = LogLimiter(log, "L3")
        self.write_back = write_policy == "write_back"
        self.write_min_hits = write_min_hits
        if self.write_back and cache.host is not None:
            cache.host.lower = self
        cache.lower = self  # a flush writes down what the store lacks before the cache drops it
        self.prefetching: list = []  # (state, future, deadline)
        self.writing: list = []
        self.stuck: list = []  # reads abandoned while still running in the store
        self._idle = False  # the last step had nothing but prefetches to wait for (wait())
        self._reads = self._writes = None  # I/O threads, started when first needed
        self.counters = dict(storage_errors=0, storage_prefetches=0, storage_prefetch_abandoned=0,
                             storage_writes_dropped=0)

    @property
    def backend(self):
        return self.store.backend

    def fleet(self) -> dict:
        """This instance and the others alive in its namespace (none seen before announce)."""
        if self.instances is None:
            return {"this_instance": self.instance_id.hex(), "others": []}
        return self.instances.stats()

    def announce(self, **info) -> "Instances":
        """Announce this instance in its namespace from now on, and watch for the others
        (instances.py); `info` joins its record. A server calls it; an engine used as a
        library, or a replay, announces nothing."""
        if self.instances is None:
            hint = getattr(self.backend, "sharing_hint", lambda: None)()
            beat = self.settings.announce_interval
            self.instances = Instances(self.backend, self.namespace, self.instance_id, self.secret,
                                       self.witness, info, beat_s=beat, stale_s=6 * beat, alone_hint=hint,
                                       alone_s=max(ALONE_S, 12 * beat))
            self.instances.start()
        else:
            self.instances.describe(**info)
        return self.instances

    # ------------------------------------------------------------------ reads
    @property
    def refused(self) -> bool:
        """The namespace holds other weights' witness: no reads, no writes."""
        return self.witness is not None and self.witness.refused

    def worth_reading(self, state) -> bool:
        """The store may hold the prefix deep enough past what the device resumes from,
        and may be read: not refused, and not with every read thread stuck in it."""
        if self.refused or self._stalled():
            return False
        return len(state.tokens) - 1 - state.prefix_len >= self.threshold

    def _stalled(self) -> bool:
        """Every read thread is busy with a read abandoned long ago: a new read would only
        queue behind them, so requests compute until one comes back."""
        self.stuck = [f for f in self.stuck if not f.done()]
        return len(self.stuck) >= READ_THREADS

    def prefetch(self, state) -> None:
        """Look the prefix up and read it on an I/O thread; nothing touches the pools
        until `poll` applies it (the request's own pages and slot are its own meanwhile)."""
        if self._reads is None:
            self._reads = DaemonThreads(READ_THREADS, "uniradix-l3")
        fut = self._reads.submit(self._read, state.tokens[:-1], state.prefix_len, state.pages,
                                 state.state_slot, state.salt)
        n = len(state.tokens) - 1 - state.prefix_len
        patience = self.io_timeout if self.policy == "wait_complete" else self.settings.prefetch_timeout(n)
        self.prefetching.append((state, fut, time.perf_counter() + min(patience, self.io_timeout)))
        self.counters["storage_prefetches"] += 1

    def _read(self, tokens, start, pages, state_slot, salt):
        """A prefetch on the I/O thread: the witness first, then the store's read."""
        w = self.witness
        try:
            if w is not None and not w.allows():
                return None
            return self.store.prefetch(tokens, start, pages, state_slot, salt, self.threshold)
        except StorageUnavailable:
            if w is not None:
                w.forget()
            raise

    def poll(self) -> list:
        """The prefetches that are over (read, failed, or out of patience, as the policy
        says): [(state, boundary it resumes at, or the exception applying it raised)].
        What was read is in the request's pages by then (through the host tier when
        there is one, layer by layer under the forward). Never waits: wait_complete keeps
        a request here until its read ends or `io_timeout` passes (then it computes, and
        the read counts as a storage error), while the others run."""
        now, keep, out = time.perf_counter(), [], []
        # best_effort waits only while the engine has nothing else to run (see wait)
        patient = self.policy != "best_effort" or self._idle
        self._idle = False
        for entry in self.prefetching:
            state, fut, deadline = entry
            if not fut.done():
                if patient and now < deadline:
                    keep.append(entry)
                    continue
                # best_effort did not wait; timeout gave up; wait_complete ran out of io_timeout
                if not fut.cancel():
                    self.stuck.append(fut)  # still running in the store: its thread is busy
                self.counters["storage_prefetch_abandoned"] += 1
                if self.policy == "wait_complete":
                    self.counters["storage_errors"] += 1
                    self._warn.failure("reads abandoned", "an L3 read took longer than io_timeout (%gs): "
                                       "abandoned, the request computes", self.io_timeout)
                out.append((state, state.prefix_len))
                continue
            try:
                out.append((state, self._apply(state, fut)))
            except Exception as e:  # the request fails alone (the engine aborts it)
                out.append((state, e))
        self.prefetching = keep
        return out

    def _apply(self, state, fut) -> int:
        b = state.prefix_len
        try:
            got = fut.result()
        except StorageUnavailable:
            self.counters["storage_errors"] += 1
            return b
        except Exception:  # a backend bug must not take the engine down: compute instead
            log.exception("L3 prefetch failed")
            self.counters["storage_errors"] += 1
            return b
        if got is None:
            return b
        cache = self.cache
        cache.sync_loads()  # a host load into the same state slot ends first
        if not cache.take_window(state, got.b):  # no room for the window a resume there reads: compute
            return b
        self.store.bind(got, state.pages)
        if cache.stage_fetched(state, got):
            self.store.count_applied(got)
        else:  # no host tier, or no room there: straight into the device pages
            self.store.apply(got)
        cache.resumed_from(state, got.b)
        state.cross_instance_tokens = got.cross_instance   # counted by the engine at admission
        return got.b

    def drop(self, state) -> None:
        """Forget a request's prefetch (it failed): its future is abandoned."""
        self.prefetching = [p for p in self.prefetching if p[0] is not state]

    def wait(self) -> None:
        """Nothing else to run: sleep until a prefetch finishes or the first deadline, in
        slices of at most WAIT_SLICE_S (the scheduler's thread also answers /metrics and
        stops between them); the next poll then keeps even best_effort reads until their
        deadline."""
        if not self.prefetching:
            return
        self._idle = True
        first = min(d for _, _, d in self.prefetching)
        wait([f for _, f, _ in self.prefetching], timeout=min(WAIT_SLICE_S, max(0.0, first - time.perf_counter())),
             return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------------ writes
    def write_through(self, state) -> None:
        """A finished request's path goes to the store: read here (this thread owns the
        tree and the pools), asked and written on the I/O thread. Under write_back the
        store gets only what the host tier evicts, and a refused store nothing."""
        if self.write_back or self.refused:
            return
        self.cache.sync_loads()  # the path may hold pages a load is still filling
        try:
            job = self.store.prepare_cached(state.tokens[:state.computed], state.salt, self.write_min_hits)
        except Exception:  # the request is cached and done; the store only misses a write
            log.exception("L3 write-through failed")
            self.counters["storage_errors"] += 1
            return
        self._submit(job)

    def write_back_node(self, nd, ci: int) -> None:
        """The host tier is about to lose slot (nd, ci), its last copy: what the
        boundaries that read it need (with the earlier pages and every component's data
        they need, from whichever tier holds them) is read now and written to the store
        on the I/O thread."""
        if self.refused:
            return
        try:
            self._submit(self.store.prepare_write_back(nd, ci))
        except Exception:  # the host copy is lost either way; only L3 misses it
            log.exception("L3 write-back failed")
            self.counters["storage_errors"] += 1

    def write_down(self, timeout: float | None = None) -> bool:
        """Before the cache drops what it holds (a flush, a graceful shutdown), under
        every policy: what every path of the tree lets a reader resume from goes down as
        its writes would have sent it (selective write-through: only nodes accessed
        write_min_hits times). What the store was believed to have is re-checked first,
        so what it lost goes down too; then what it lacks is read chunk by chunk (at most
        two chunks in memory) and written. Waits at most `timeout` seconds (default
        io_timeout); True when all of it reached the store (False: cut short, or a write
        failed, counted in storage_errors)."""
        if self.refused:
            return True
        self.cache.sync_loads()
        failed = self._failed_writes()
        limit = self.io_timeout if timeout is None else max(timeout, 0.0)
        deadline = time.monotonic() + limit
        # writes already queued hold their keys (a new job skips them): they land first
        if not self.poll_writes(wait_all=True, timeout=limit):
            return self._late(limit)
        jobs = None
        try:
            for send in (False, True):  # re-check the beliefs, then send what is missing
                jobs = self.store.prepare_all(self.write_min_hits, WRITE_DOWN_CHUNK, send=send, recheck=not send)
                last = None
                for job in jobs:  # root side first, on the one write thread: earlier pages go first
                    if last is not None and not _wait_until(last, deadline):
                        self.store.discard(job)
                        return self._late(limit)
                    last = self._submit(job, force=True)
                if last is not None and not _wait_until(last, deadline):
                    return self._late(limit)
        except Exception:  # the cache drops it anyway; only L3 misses it
            log.exception("L3 write-down failed")
            self.counters["storage_errors"] += 1
            return False
        finally:
            if jobs is not None:
                jobs.close()  # an abandoned generator gives back what it held
        return self._failed_writes() == failed

    def _failed_writes(self) -> int:
        """Writes that failed so far (calls that raised, sets refused)."""
        c = self.store.counters
        return c["errors"] + c["failed_sets"]

    def _late(self, limit: float) -> bool:
        self.counters["storage_errors"] += 1
        self._warn.failure("write-downs cut short", "writing the cache down to L3 took longer than "
                           "%gs: the rest was not written", limit)
        return False

    def _submit(self, job, force: bool = False):
        """Queue a prepared job on the write thread; returns its future (None when there
        was nothing to write, or the queue was full: then it is dropped, counted, unless
        `force`)."""
        if job is None:
            return None
        self.poll_writes()
        if len(self.writing) >= MAX_PENDING_WRITES and not force:  # the store falls behind: dropped
            self.counters["storage_writes_dropped"] += 1
            self.store.discard(job)
            return None
        if self._writes is None:
            self._writes = DaemonThreads(WRITE_THREADS, "uniradix-l3-write")
        fut = self._writes.submit(self._commit, job)
        fut.job = job  # what close() gives back if it never runs
        self.writing.append(fut)
        return fut

    def _commit(self, job) -> int:
        """A write on the I/O thread: the witness first, then the store's commit (which
        counts its own outcome)."""
        w = self.witness
        if w is not None:
            try:
                if not w.allows():
                    self.store.discard(job)
                    return 0
            except Exception as e:  # the store cannot say: this write is skipped, counted
                w.forget()
                self.store._count("errors")
                self._warn.failure("writes skipped", "an L3 write was skipped: %s", e)
                self.store.discard(job)
                return 0
        lost = self.store.counters["lost"]
        written = self.store.commit(job)
        if w is not None and self.store.counters["lost"] != lost:
            w.forget()   # the store lost objects (emptied, evicted): its witness too, maybe
        return written

    def poll_writes(self, wait_all: bool = False, timeout: float | None = None) -> bool:
        """Forget finished writes (commit counts its own outcome); with `wait_all`, first
        let every pending one finish, for at most `timeout` seconds (default io_timeout).
        True when none is pending."""
        if wait_all and self.writing:
            limit = self.io_timeout if timeout is None else min(max(timeout, 0.0), self.io_timeout)
            wait(self.writing, timeout=limit)
        self.writing = [f for f in self.writing if not f.done()]
        return not self.writing

    def close(self, timeout: float | None = None) -> None:
        """Finish the writes (for at most `timeout` seconds, default io_timeout), stop the
        I/O threads without waiting for a call stuck in the store (a daemon thread; it
        ends with the process), log what was not reported."""
        if not self.poll_writes(wait_all=True, timeout=timeout):
            n = len(self.writing)
            for f in self.writing:
                if f.cancel():  # queued, never to run: its keys may be claimed again
                    self.store.discard(f.job)
            self.counters["storage_writes_dropped"] += n
            self.counters["storage_errors"] += n
            self._warn.failure("writes abandoned", "%d L3 write(s) still pending at close: abandoned", n,
                               count=n)
            self.writing = []
        for threads in (self._reads, self._writes):
            if threads is not None:
                threads.shutdown()
        self._reads = self._writes = None
        self.stuck = []
        if self.instances is not None:
            self.instances.close(min(2.0, self.io_timeout))
        self._warn.flush()
        self.store.close()

    #: what stats() reports, for an engine without a storage tier: all zero
    IDLE = dict(storage_instances_seen=0, storage_instance_records_invalid=0, storage_errors=0,
                storage_prefetches=0, storage_prefetch_abandoned=0,
                storage_writes_dropped=0, storage_loads=0, storage_failed_loads=0, storage_saved_objects=0,
                storage_pending_writes=0, storage_read_bytes=0, storage_written_bytes=0, storage_corrupt_objects=0,
                storage_witness_mismatch=0, storage_refused=0, storage_lost_objects=0)

    def stats(self) -> dict:
        lc = dict(self.store.counters)
        c = dict(self.counters)
        c["storage_loads"] = lc["loads"]
        c["storage_failed_loads"] = lc["failed_loads"]
        c["storage_saved_objects"] = lc["saved_objects"]
        c["storage_read_bytes"] = lc["loaded_bytes"]
        c["storage_written_bytes"] = lc["saved_bytes"]
        c["storage_lost_objects"] = lc["lost"]  # believed stored, found missing: written again
        c["storage_corrupt_objects"] = lc["corrupt"] + lc["unauthenticated"]
        storage = self.store.stats()
        # every failure counts: calls that raised, here or on the I/O threads, sets
        # refused, and entries the backend found unreadable under a key's name
        c["storage_errors"] += lc["errors"] + lc["failed_sets"] + storage["backend"].get("unreadable", 0)
        c["storage_pending_writes"] = sum(not f.done() for f in self.writing)   # not yet pruned: done ones too
        w = self.witness
        c["storage_witness_mismatch"] = 0 if w is None else w.mismatches
        c["storage_refused"] = int(self.refused)
        fleet = self.fleet()
        c["storage_instances_seen"] = len(fleet["others"])
        c["storage_instance_records_invalid"] = fleet.get("invalid_records", 0)
        if w is not None:
            storage["witness"] = dict(state=w.state, stored_as=w.key, mine=w.mine, theirs=w.theirs)  # "key" would read as a secret
        storage["instances"] = fleet
        c["storage"] = storage
        return c
