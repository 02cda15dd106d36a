"""The storage tier (L3): one owner for shared storage. It names the data (the
namespace: the model, its weights' fingerprint, page size, rank, and each request's
salt; a secret for the objects' MAC), reads prefixes a request could resume from deeper
than the device allows (on I/O threads, waiting as the prefetch policy says), writes
finished work through (the pools read on the scheduler's thread, the store asked and
written on an I/O thread), and takes what the host tier is about to lose (write_back).
A store that fails costs only reuse: the request computes, the error is counted."""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from .keys import StorageNamespace
from .objects import resolve_secret
from .storage import StorageUnavailable
from .store import L3Store

log = logging.getLogger("uniradix.hicache")

#: writes queued on the I/O thread beyond which new ones are dropped (and counted)
MAX_PENDING_WRITES = 256


class StorageTier:
    """cache: the UnifiedRadixCache whose pools it reads and fills; backend: a
    StorageBackend (the caller's: close it yourself); settings: a config.StorageConfig;
    write_policy, write_min_hits: the host tier's policy (write_back: only what the host
    evicts goes down); weights: the weights' fingerprint (ignored when the settings name
    the model themselves)."""

    def __init__(self, cache, backend, settings, model, *, weights: str = "", write_policy: str = "write_through",
                 write_min_hits: int = 0) -> None:
        self.cache = cache
        self.settings = settings
        self.policy = settings.hicache_storage_prefetch_policy
        self.threshold = max(settings.prefetch_threshold, 1)
        if settings.model_fingerprint is not None:  # the fleet names the model (and its weights) itself
            ns = StorageNamespace.for_model(settings.model_fingerprint, cache.page_size, settings.rank)
        else:
            ns = StorageNamespace.for_model(model, cache.page_size, settings.rank, weights=weights)
        secret = resolve_secret(settings.auth_secret)
        self.store = L3Store(cache, backend, ns, secret)
        self.write_back = write_policy == "write_back"
        self.write_min_hits = write_min_hits
        if self.write_back and cache.host is not None:
            cache.host.lower = self
        self.prefetching: list = []  # (state, future, deadline)
        self.writing: list = []
        self._reads = self._writes = None  # I/O threads, started when first needed
        self.counters = dict(storage_tokens=0, storage_errors=0, storage_prefetches=0,
                             storage_prefetch_abandoned=0, storage_writes_dropped=0)

    @property
    def backend(self):
        return self.store.backend

    # ------------------------------------------------------------------ reads
    def worth_reading(self, state) -> bool:
        """The store may hold the prefix deep enough past what the device resumes from."""
        return len(state.tokens) - 1 - state.prefix_len >= self.threshold

    def prefetch(self, state) -> None:
        """Look the prefix up and read it on an I/O thread; nothing touches the pools
        until `poll` applies it (the request's own pages and slot are its own meanwhile)."""
        if self._reads is None:
            self._reads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="uniradix-l3")
        fut = self._reads.submit(self.store.prefetch, state.tokens[:-1], state.prefix_len, state.pages,
                                 state.state_slot, state.salt, self.threshold)
        n = len(state.tokens) - 1 - state.prefix_len
        self.prefetching.append((state, fut, time.perf_counter() + self.settings.prefetch_timeout(n)))
        self.counters["storage_prefetches"] += 1

    def poll(self) -> list:
        """The prefetches that are over (read, failed, or out of patience, as the policy
        says): [(state, boundary it resumes at, or the exception applying it raised)].
        What was read is in the request's pages by then (through the host tier when
        there is one, layer by layer under the forward)."""
        now, keep, out = time.perf_counter(), [], []
        for entry in self.prefetching:
            state, fut, deadline = entry
            if not fut.done():
                if self.policy == "wait_complete":
                    fut.exception()  # blocks: this policy waits for the store
                elif self.policy == "timeout" and now < deadline:
                    keep.append(entry)
                    continue
                else:  # best_effort does not wait; timeout gave up: compute instead
                    fut.cancel()
                    self.counters["storage_prefetch_abandoned"] += 1
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
        if cache.stage_fetched(state, got):
            self.store.count_applied(got)
        else:  # no host tier, or no room there: straight into the device pages
            self.store.apply(got)
        cache.resumed_from(state, got.b)
        self.counters["storage_tokens"] += got.b - b
        return got.b

    def drop(self, state) -> None:
        """Forget a request's prefetch (it failed): its future is abandoned."""
        self.prefetching = [p for p in self.prefetching if p[0] is not state]

    def wait(self) -> None:
        """Nothing else to run: sleep until a prefetch finishes or the first deadline."""
        if not self.prefetching:
            return
        first = min(d for _, _, d in self.prefetching)
        wait([f for _, f, _ in self.prefetching], timeout=max(0.0, first - time.perf_counter()),
             return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------------ writes
    def write_through(self, state) -> None:
        """A finished request's path goes to the store: read here (this thread owns the
        tree and the pools), asked and written on the I/O thread. Under write_back the
        store gets only what the host tier evicts."""
        if self.write_back:
            return
        self.cache.sync_loads()  # the path may hold pages a load is still filling
        try:
            job = self.store.prepare_cached(state.tokens[:state.computed], state.salt, self.write_min_hits)
        except Exception:  # the request is cached and done; the store only misses a write
            log.exception("L3 write-through failed")
            self.counters["storage_errors"] += 1
            return
        self._submit(job)

    def write_back_node(self, nd) -> None:
        """The host tier is about to lose what node nd holds only there: its bytes are
        read now and written to the store on the I/O thread."""
        try:
            self._submit(self.store.prepare_host_node(nd))
        except Exception:  # the host copy is lost either way; only L3 misses it
            log.exception("L3 write-back failed")
            self.counters["storage_errors"] += 1

    def _submit(self, job) -> None:
        if job is None:
            return
        self.poll_writes()
        if len(self.writing) >= MAX_PENDING_WRITES:  # the store falls behind: this write is dropped
            self.counters["storage_writes_dropped"] += 1
            return
        if self._writes is None:
            self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="uniradix-l3-write")
        self.writing.append(self._writes.submit(self.store.commit, job))

    def poll_writes(self, wait_all: bool = False) -> None:
        """Forget finished writes (commit counts its own outcome); with `wait_all`, first
        let every pending one finish."""
        if wait_all:
            for f in self.writing:
                f.exception()
        self.writing = [f for f in self.writing if not f.done()]

    def close(self) -> None:
        """Finish the writes, stop the I/O threads, log what was not reported."""
        self.poll_writes(wait_all=True)
        for ex in (self._reads, self._writes):
            if ex is not None:
                ex.shutdown(wait=True, cancel_futures=True)
        self._reads = self._writes = None
        self.store.close()

    #: what stats() reports, for an engine without a storage tier: all zero
    IDLE = dict(storage_tokens=0, storage_errors=0, storage_prefetches=0, storage_prefetch_abandoned=0,
                storage_writes_dropped=0, storage_loads=0, storage_failed_loads=0, storage_saved_objects=0,
                storage_pending_writes=0, storage_read_bytes=0, storage_written_bytes=0, storage_corrupt_objects=0)

    def stats(self) -> dict:
        lc = dict(self.store.counters)
        c = dict(self.counters)
        c["storage_loads"] = lc["loads"]
        c["storage_failed_loads"] = lc["failed_loads"]
        c["storage_saved_objects"] = lc["saved_objects"]
        c["storage_read_bytes"] = lc["loaded_bytes"]
        c["storage_written_bytes"] = lc["saved_bytes"]
        c["storage_corrupt_objects"] = lc["corrupt"] + lc["unauthenticated"]
        # every failure counts: calls that raised, here or on the I/O threads, and sets refused
        c["storage_errors"] += lc["errors"] + lc["failed_sets"]
        c["storage_pending_writes"] = len(self.writing)
        c["storage"] = self.store.stats()
        return c
