"""The reference engine: requests go match -> lock -> allocate -> prefill from the safe
boundary -> decode -> cache, with continuous batching and admission control.

Prefill and decode are one mechanism: a running sequence has `tokens` (prompt plus
what it generated) of which `computed` are in its pages and recurrent state; each step
runs the next chunk of the rest (one token when decoding) and samples when it reaches
the end. The recurrent state is copied out (checkpoints) at the junction, at the
prompt's resume point (all but its last token, page-aligned: where the same prompt sent
again resumes) and, while decoding, at each page boundary; the SWA window before the
junction and the resume point is kept, so the tree can resume later requests there."""
from __future__ import annotations

import logging
import os
import time
from collections import deque

import torch

from ..cache import CacheFull, CachedRequest
from ..model import ByteTokenizer, HybridConfig, init_weights, load_weights, preset
from ..model.paged import PagedInput, paged_forward
from ..tree.component import page_floor
from .build import build_cache
from .request import Request, SamplingParams
from .sampling import sample


log = logging.getLogger("uniradix.engine")

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
#: L3 writes queued on the I/O thread beyond which new ones are dropped (and counted)
MAX_PENDING_WRITES = 256


class _Seq:
    """A request while the engine holds it (waiting or running)."""

    __slots__ = ("req", "tokens", "creq", "computed", "target", "capture", "tail", "generator")

    def __init__(self, req: Request, tokens: list[int]) -> None:
        self.req = req
        self.tokens = tokens
        self.creq: CachedRequest | None = None
        self.computed = 0
        self.target = 0           # the tokens known at admission: below this is prefill
        self.capture: dict[int, int] = {}
        self.tail: int | None = None  # position of the rolling decode checkpoint
        seed = req.sampling.seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)


class Engine:
    """The reference hybrid model behind a UnifiedRadixCache.

    Flags follow SGLang's: `page_size`, `max_total_tokens` (FULL pool),
    `swa_full_tokens_ratio`, `max_mamba_cache_size`, `chunked_prefill_size`,
    `max_running_requests`, `radix_eviction_policy`, `disable_radix_cache`, `device`.
    `submit` queues requests, `step` runs one scheduling step, `run` drives a list of
    requests to the end.

    `enable_hierarchical_cache` adds the host tier (L2): host mirrors of every pool,
    `hicache_ratio` times the device pools or `hicache_size` GB. A request reuses what
    the host holds too; it is loaded back (all or nothing) layer by layer while the
    forward runs. `hicache_write_policy` says when device data is copied to the host:
    "write_through" (when a request is cached), "write_through_selective" (only nodes
    accessed `write_through_threshold` times), "write_back" (when it leaves the device).

    `storage`: a hicache StorageBackend shared with other engines (L3). Finished work
    is written through to it. A request that could resume at least
    `storage_prefetch_threshold` tokens deeper than the device allows has the store
    looked up and read on an I/O thread while the scheduler goes on; it waits as
    `storage_prefetch_policy` says: "best_effort" (not at all: what has not arrived by
    the next step is computed), "wait_complete" (until the read ends; the scheduler
    blocks), "timeout" (up to min(max, base + per_ki_token * tokens / 1024) seconds).
    The load is all or nothing. A store that fails costs only the reuse: the request
    computes, the error is counted. `hicache_write_policy` "write_through_selective"
    writes only the part of a finished request's path the tree has accessed at least
    `write_through_threshold` times."""

    def __init__(self, config: HybridConfig | str = "tiny-hybrid", *, weights: dict | None = None,
                 page_size: int = 1, max_total_tokens: int = 16384, swa_full_tokens_ratio: float = 1.0,
                 max_mamba_cache_size: int | None = None, chunked_prefill_size: int = 256,
                 max_running_requests: int = 16, radix_eviction_policy: str = "lru",
                 disable_radix_cache: bool = False, device: str = "cpu",
                 storage=None, storage_prefetch_threshold: int = 256,
                 storage_prefetch_policy: str = "best_effort", prefetch_timeout_base: float = 1.0,
                 prefetch_timeout_per_ki_token: float = 0.25, prefetch_timeout_max: float = 3.0,
                 hicache_write_policy: str = "write_through", write_through_threshold: int = 2,
                 enable_hierarchical_cache: bool = False, hicache_ratio: float = 2.0,
                 hicache_size: float | None = None, rank: int = 0, model_fingerprint: str | None = None,
                 storage_secret: str | bytes | None = None) -> None:
        self.cfg = preset(config) if isinstance(config, str) else config
        for flag, v in (("--chunked-prefill-size", chunked_prefill_size),
                        ("--max-running-requests", max_running_requests)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{flag} must be an int >= 1, got {v!r}")
        self.device = _check_device(device)
        self.weights_path = None
        if weights is None:
            w = init_weights(self.cfg)
        elif isinstance(weights, dict):
            w = weights
        else:  # a safetensors file
            self.weights_path = os.fspath(weights)
            w = load_weights(self.cfg, self.weights_path)
        self.weights = _to(w, self.device)
        if max_mamba_cache_size is None:
            max_mamba_cache_size = 4 * max_running_requests + 64
        if hicache_write_policy == "write_back" and not enable_hierarchical_cache:
            raise ValueError("write policy write_back (--hicache-write-policy) writes on eviction from the host "
                             "tier: it needs --enable-hierarchical-cache")
        self.cache, self.pools = build_cache(
            self.cfg, page_size=page_size, max_total_tokens=max_total_tokens,
            swa_full_tokens_ratio=swa_full_tokens_ratio, max_mamba_cache_size=max_mamba_cache_size,
            eviction_policy=radix_eviction_policy, device=self.device,
            hierarchical=enable_hierarchical_cache and not disable_radix_cache,
            hicache_ratio=hicache_ratio, hicache_size=hicache_size or None,
            write_policy=hicache_write_policy, write_through_threshold=write_through_threshold)
        self.hierarchical = self.cache.host_pools is not None
        self.page_size = page_size
        self.chunk = chunked_prefill_size
        self.max_running = max_running_requests
        self.use_cache = not disable_radix_cache
        self.has_state = "mamba" in self.pools
        self.has_window = "swa" in self.pools
        self.tokenizer = ByteTokenizer()
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.counters = dict(steps=0, finished=0, errors=0, preemptions=0, prefill_tokens=0,
                             cached_tokens=0, prompt_tokens=0, decode_tokens=0, checkpoints_skipped=0,
                             storage_tokens=0, storage_errors=0, storage_prefetches=0,
                             storage_prefetch_abandoned=0, storage_writes_dropped=0, host_tokens=0)
        self.l3 = None
        self._io = None
        self._io_write = None
        self.prefetching: list = []
        self.writing: list = []  # L3 writes on the I/O thread
        if storage_prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"unknown prefetch policy {storage_prefetch_policy!r}; "
                             f"choose one of {', '.join(PREFETCH_POLICIES)}")
        for name, v in (("base", prefetch_timeout_base), ("per_ki_token", prefetch_timeout_per_ki_token),
                        ("max", prefetch_timeout_max)):
            if v < 0:
                raise ValueError(f"prefetch_timeout_{name} must be >= 0, got {v}")
        self.prefetch_policy = storage_prefetch_policy
        self.prefetch_timeouts = dict(base=prefetch_timeout_base, per_ki_token=prefetch_timeout_per_ki_token,
                                      max=prefetch_timeout_max)
        if storage is not None:
            from ..hicache import StorageNamespace
            from ..hicache.l3 import L3Store
            if storage_prefetch_threshold < 0:
                raise ValueError(f"storage_prefetch_threshold must be >= 0, got {storage_prefetch_threshold}")
            from ..hicache.objects import resolve_secret
            secret = storage_secret if isinstance(storage_secret, bytes) else resolve_secret(storage_secret)
            if model_fingerprint is not None:  # the fleet names the model (and its weights) itself
                if not isinstance(model_fingerprint, str) or not model_fingerprint:
                    raise ValueError(f"model_fingerprint must be a non-empty string, got {model_fingerprint!r}")
                ns = StorageNamespace.for_model(model_fingerprint, page_size, rank)
            else:
                ns = StorageNamespace.for_model(self.cfg, page_size, rank, weights=self._weights_fingerprint())
            self.l3 = L3Store(self.cache, storage, ns, secret)
            self.storage_threshold = max(storage_prefetch_threshold, 1)
            if hicache_write_policy == "write_back" and self.hierarchical:
                self.cache.host_evict_hook = self._write_back_node

    def _weights_fingerprint(self) -> str:
        """What the L3 namespace knows the weights by: a file's content digest (cached on
        disk by path, size and mtime, so a restart does not rehash it), else a digest of
        the tensors themselves."""
        from ..model.fingerprint import file_fingerprint, weights_fingerprint
        if self.weights_path is not None:
            return file_fingerprint(self.weights_path)
        return weights_fingerprint(self.weights)

    # ------------------------------------------------------------------ requests in
    def submit(self, req: Request) -> Request:
        """Queue a request. Malformed input raises ValueError; a request the pools could
        never hold finishes at once with status "error" and says why."""
        if req.status != "new":
            raise ValueError(f"request {req.rid} was already submitted")
        ids = req.check(self.cfg.vocab_size)
        if req.text is not None:
            ids = self.tokenizer.encode(req.text)
        if not ids:
            raise ValueError(f"request {req.rid} has an empty prompt")
        req.input_ids = ids
        req.metrics.prompt_tokens = len(ids)
        req.status = "waiting"
        why = self._never_fits(req)
        if why:
            self._fail(req, why)
        else:
            self.waiting.append(_Seq(req, list(ids)))
        return req

    def _never_fits(self, req: Request) -> str | None:
        P = self.page_size
        L = len(req.input_ids)
        total = -(-(L + req.sampling.max_new_tokens) // P)
        need = {"full": total}
        if self.has_window:
            wp = -(-self.cfg.window // P)
            need["swa"] = max(-(-L // P), min(total, 2 * wp + 3))
        for name, n in need.items():
            size = self.pools[name].size
            if n > size:
                return (f"request {req.rid} can never fit: it needs {n} {name} pages "
                        f"({L} prompt + {req.sampling.max_new_tokens} new tokens at page size {P}) "
                        f"and the pool holds {size}; raise max_total_tokens or shorten the request")
        return None

    def _abort(self, seq: _Seq, exc: BaseException, done: list[Request]) -> None:
        """Something failed inside a step because of this request (a bug, or a field
        changed after submit): it alone fails, its handles go back, and every other
        request goes on as if it had never been there."""
        req = seq.req
        log.error("request %s failed inside the engine: %s: %s", req.rid, type(exc).__name__, exc,
                  exc_info=exc)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self.prefetching = [p for p in self.prefetching if p[0] is not seq]
        creq = seq.creq
        if creq is not None:
            self._detach(seq)
            if not creq.done:
                try:
                    self.cache.release(creq)
                except Exception:  # what it holds may leak; the engine keeps serving
                    log.exception("request %s: its cache handles could not be returned", req.rid)
        self._fail(req, f"request {req.rid} failed: {type(exc).__name__}: {exc}")
        done.append(req)

    def _fail(self, req: Request, why: str) -> None:
        req.status = "error"
        req.error = why
        req.finish_reason = "error"
        req.metrics.finished = time.perf_counter()
        self.counters["errors"] += 1

    # ------------------------------------------------------------------ driving
    def run(self, requests: list[Request], progress=None) -> list[Request]:
        """Submit the requests and step until all are done and their L3 writes have
        reached the store; `progress(req)` is called as each one finishes."""
        for r in requests:
            if r.status == "new":
                self.submit(r)
            if r.done and progress:
                progress(r)
        while self.waiting or self.running or self.prefetching:
            for r in self.step():
                if progress:
                    progress(r)
        self.flush_writes()  # the run is over once its work is in the store too
        return requests

    def generate(self, input_ids=None, text=None, **sampling) -> Request:
        """One request, run to the end (a convenience for scripts and tests)."""
        req = Request(input_ids=input_ids, text=text, sampling=SamplingParams(**sampling))
        return self.run([req])[0]

    def step(self) -> list[Request]:
        """Admit what fits, run one batched forward (prefill chunks and one decode token
        per decoding request), sample, and finish what is done. Returns the requests
        that finished (or failed) in this step."""
        done: list[Request] = []
        if self.prefetching:
            self._poll_prefetches(done)
        if self.writing:
            self._poll_writes()
        self._admit(done)
        batch = self._schedule(done)
        if not batch and self.prefetching:
            self._wait_for_prefetch()
        if batch:
            self.counters["steps"] += 1
            for (seq, inp), lg in zip(batch, self._forward(batch, done)):
                if lg is None:
                    continue
                try:
                    self._advance(seq, inp, lg, done)
                except Exception as e:
                    self._abort(seq, e, done)
        return done

    def _forward(self, batch: list, done: list[Request]) -> list:
        """Logits per batch entry. When the batched forward fails, each request runs alone
        so that only the one that fails is aborted (None in its place); the forward
        commits recurrent state only once it has run every layer, so a failed attempt
        leaves no request's state advanced."""
        cache = self.cache
        wait = cache.wait_layer if cache.pending_loads else None  # host loads still copying
        try:
            logits = paged_forward(self.cfg, self.weights, self.pools, [inp for _, inp in batch],
                                   wait_layer=wait)
        except Exception as e:
            if len(batch) == 1:
                logits = [None]
                self._abort(batch[0][0], e, done)
            else:
                logits = [self._forward_alone(seq, inp, wait, done) for seq, inp in batch]
        if wait is not None:
            cache.sync_loads()
        return logits

    def _forward_alone(self, seq: _Seq, inp: PagedInput, wait, done: list[Request]):
        try:
            return paged_forward(self.cfg, self.weights, self.pools, [inp], wait_layer=wait)[0]
        except Exception as e:
            self._abort(seq, e, done)
            return None

    # ------------------------------------------------------------------ admission
    def _admit(self, done: list[Request]) -> None:
        while self.waiting and len(self.running) + len(self.prefetching) < self.max_running:
            seq = self.waiting[0]
            req = seq.req
            try:
                creq = self._match(seq)
            except CacheFull as e:
                if self.running or self.prefetching:
                    return  # it waits for admitted requests to free their pages
                self.waiting.popleft()
                self._fail(req, f"request {req.rid} can never fit: {e}")
                done.append(req)
                continue
            except Exception as e:
                self._abort(seq, e, done)
                continue
            self.waiting.popleft()
            seq.creq = creq
            try:
                if creq.state_slot is not None and creq.prefix_len == 0:  # nothing to resume: zeros
                    self.pools["mamba"].zero_slots([creq.state_slot])
                if self.l3 is not None and self.use_cache and \
                        len(seq.tokens) - 1 - creq.prefix_len >= self.storage_threshold:
                    self._prefetch(seq)
                    continue
                self._start(seq, creq.prefix_len)
            except Exception as e:
                self._abort(seq, e, done)

    def _start(self, seq: _Seq, b: int) -> None:
        """The request resumes at b (its device boundary, or deeper from L3): running."""
        req, creq = seq.req, seq.creq
        seq.computed = b
        seq.target = len(seq.tokens)
        if req.status in ("waiting", "prefetching"):  # first admission, not a preempted one
            req.metrics.cached_tokens = b
            req.metrics.host_tokens = creq.host_tokens
            req.metrics.storage_tokens = b - creq.prefix_len
            self.counters["host_tokens"] += creq.host_tokens
            self.counters["cached_tokens"] += b
            self.counters["prompt_tokens"] += len(seq.tokens)
        req.status = "running"
        seq.capture = {}
        P = self.page_size
        # the same prompt sent again matches all but its last token: it resumes here
        end = page_floor(seq.target - 1, P)
        if self.use_cache and end > b and (self.has_window or self.has_state):
            creq.resume_points.append(end)
        if self.has_state and self.use_cache:
            for pos in {page_floor(creq.matched, P), end}:
                if pos > b:
                    slot = self._checkpoint(creq, pos)
                    if slot is not None:
                        seq.capture[pos] = slot
        self.running.append(seq)

    # ------------------------------------------------------------------ L3 prefetch
    def _prefetch(self, seq: _Seq) -> None:
        """Look the prefix up in L3 and read it on an I/O thread; the request waits (in
        `prefetching`) as the policy says. Nothing touches the pools until it is applied."""
        creq, req = seq.creq, seq.req
        if self._io is None:
            from concurrent.futures import ThreadPoolExecutor
            self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="uniradix-l3")
        # the request's own pages and slot are its own until it starts: the thread may read them
        fut = self._io.submit(self.l3.prefetch, seq.tokens[:-1], creq.prefix_len, creq.pages,
                              creq.state_slot, req.salt, self.storage_threshold)
        n = len(seq.tokens) - 1 - creq.prefix_len
        p = self.prefetch_timeouts
        deadline = time.perf_counter() + min(p["max"], p["base"] + p["per_ki_token"] * n / 1024)
        if req.status == "waiting":
            req.status = "prefetching"
        self.prefetching.append((seq, fut, deadline))
        self.counters["storage_prefetches"] += 1

    def _poll_prefetches(self, done: list[Request]) -> None:
        """Start the requests whose prefetch finished, failed, or ran out of patience."""
        now = time.perf_counter()
        keep = []
        for seq, fut, deadline in list(self.prefetching):
            try:
                if self._poll_prefetch(seq, fut, deadline, now):
                    keep.append((seq, fut, deadline))
            except Exception as e:
                self._abort(seq, e, done)
        self.prefetching = [p for p in keep if p[0].creq is not None]

    def _poll_prefetch(self, seq: _Seq, fut, deadline: float, now: float) -> bool:
        """Start the request if its prefetch is over; True while it still waits."""
        from ..hicache import StorageUnavailable
        if not fut.done():
            if self.prefetch_policy == "wait_complete":
                fut.exception()  # blocks: this policy waits for the store
            elif self.prefetch_policy == "timeout" and now < deadline:
                return True
            else:  # best_effort does not wait; timeout gave up: compute instead
                fut.cancel()
                self.counters["storage_prefetch_abandoned"] += 1
                self._start(seq, seq.creq.prefix_len)
                return False
        creq = seq.creq
        b = creq.prefix_len
        try:
            got = fut.result()
        except StorageUnavailable:
            self.counters["storage_errors"] += 1
            got = None
        except Exception:  # a backend bug must not take the engine down: compute instead
            log.exception("L3 prefetch for request %s failed", seq.req.rid)
            self.counters["storage_errors"] += 1
            got = None
        if got is not None:
            self.cache.sync_loads()  # a host load into the same state slot ends first
            # through the host tier when there is one (loaded layer by layer under the
            # forward); else, or when the host is full, straight into the device pages
            if self.hierarchical and self.cache.stage_fetched(creq, got):
                self.l3.count_applied(got)
            else:
                self.l3.apply(got)
            self.cache.resumed_from(creq, got.b)
            self.counters["storage_tokens"] += got.b - b
            b = got.b
        self._start(seq, b)
        return False

    def _wait_for_prefetch(self) -> None:
        """Nothing to compute: sleep until a prefetch finishes or the first deadline."""
        from concurrent.futures import FIRST_COMPLETED, wait
        first = min(d for _, _, d in self.prefetching)
        wait([f for _, f, _ in self.prefetching], timeout=max(0.0, first - time.perf_counter()),
             return_when=FIRST_COMPLETED)

    def close(self) -> None:
        """Stop the I/O threads and wait for host loads (the store itself belongs to the
        caller)."""
        self.cache.sync_loads()
        self.flush_writes()
        for name in ("_io", "_io_write"):
            ex = getattr(self, name)
            if ex is not None:
                ex.shutdown(wait=True, cancel_futures=True)
                setattr(self, name, None)
        if self.l3 is not None:
            self.l3.close()

    def _match(self, seq: _Seq) -> CachedRequest:
        """Match all but the last token, so at least one is computed and gives the
        logits to sample from, and allocate pages for all of them; all or nothing."""
        req = seq.req
        creq = self.cache.match_prefix(seq.tokens[:-1], req.salt, req.priority, alloc=True)
        try:
            self.cache.alloc_request(creq, len(seq.tokens))
        except CacheFull:
            self.cache.release(creq)
            raise
        return creq

    def _checkpoint(self, creq: CachedRequest, pos: int) -> int | None:
        """A slot to capture the state at pos; skipped (None) when the pool is short,
        since a checkpoint only saves later work."""
        try:
            return self.cache.add_checkpoint(creq, pos)
        except CacheFull:
            self.counters["checkpoints_skipped"] += 1
            return None

    # ------------------------------------------------------------------ scheduling
    def _schedule(self, done: list[Request]) -> list[tuple[_Seq, PagedInput]]:
        budget = self.chunk
        batch = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted to make room for an earlier one
            n = len(seq.tokens) - seq.computed
            if n > 1:  # prefill, within the step's token budget
                n = min(n, budget)
                if n == 0:
                    continue
                budget -= n
            try:
                if n == 1 and not self._grow(seq, done):
                    continue
                batch.append((seq, self._input(seq, n)))
            except Exception as e:
                self._abort(seq, e, done)
        return batch

    def _grow(self, seq: _Seq, done: list[Request]) -> bool:
        """Pages for the token a decoding sequence is about to compute. On a shortfall
        the newest decoding sequence is preempted (its work is cached, it re-queues at
        the front) until this one fits; False when this one was preempted itself."""
        creq = seq.creq
        while True:
            try:
                if creq.num_tokens < len(seq.tokens):
                    self.cache.append_tokens(creq, seq.tokens[creq.num_tokens:])
                return True
            except CacheFull:
                victim = next((s for s in reversed(self.running)
                               if s.creq.num_tokens <= s.computed), seq)
                if victim is seq and len(self.running) == 1 and not self.prefetching:
                    self.running.remove(seq)
                    self._release(seq)
                    self._fail(seq.req, f"request {seq.req.rid} can never fit: the pools cannot "
                                        f"hold {len(seq.tokens)} tokens")
                    done.append(seq.req)
                    return False
                self._preempt(victim, done)
                if victim is seq:
                    return False

    def _preempt(self, seq: _Seq, done: list[Request]) -> None:
        self.running.remove(seq)
        try:
            self._store(seq)
        except Exception as e:
            self._abort(seq, e, done)
            return
        seq.req.status = "preempted"
        seq.req.metrics.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(seq)

    def _input(self, seq: _Seq, n: int) -> PagedInput:
        creq = seq.creq
        s = seq.computed
        e = s + n
        capture = {p: slot for p, slot in seq.capture.items() if s < p <= e}
        P = self.page_size
        if self.has_state and self.use_cache and P > 1 and e >= seq.target and e % P == 0 \
                and e not in creq.checkpoints:
            # the rolling decode checkpoint moves to each page boundary it passes
            if seq.tail is not None:
                slot = creq.checkpoints.pop(seq.tail)
                creq.checkpoints[e] = slot
            else:
                slot = self._checkpoint(creq, e)
            if slot is not None:
                seq.tail = e
                capture[e] = slot
        pages = creq.pages
        return PagedInput(seq.tokens[s:e], s, pages["full"], pages.get("swa"), creq.state_slot, capture)

    # ------------------------------------------------------------------ after the forward
    def _advance(self, seq: _Seq, inp: PagedInput, logits: torch.Tensor, done: list[Request]) -> None:
        req, creq = seq.req, seq.creq
        n = len(inp.tokens)
        prefill = min(seq.computed + n, seq.target) - min(seq.computed, seq.target)
        req.metrics.computed_tokens += prefill
        self.counters["prefill_tokens"] += prefill
        self.counters["decode_tokens"] += n - prefill
        seq.computed += n
        creq.state_len = seq.computed
        if self.has_window:
            self.cache.release_out_of_window(creq, seq.computed)
        if seq.computed < len(seq.tokens):
            return
        row = logits[-1]
        if req.record_logits:
            req.logits.append(row.detach().to("cpu", copy=True))
        tok = sample(row, req.sampling, seq.generator)
        now = time.perf_counter()
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        req.output_ids.append(tok)
        seq.tokens.append(tok)
        req.metrics.output_tokens = len(req.output_ids)
        if tok in req.sampling.stop_ids:
            req.finish_reason = "stop"
        elif len(req.output_ids) >= req.sampling.max_new_tokens:
            req.finish_reason = "length"
        else:
            return
        self.running.remove(seq)
        self._store(seq, req.session_id)
        req.status = "finished"
        req.metrics.finished = now
        self.counters["finished"] += 1
        done.append(req)

    @staticmethod
    def _detach(seq: _Seq) -> CachedRequest:
        """The sequence gives up its cache request (finished, preempted or failed)."""
        creq = seq.creq
        seq.creq, seq.capture, seq.tail = None, {}, None
        return creq

    def _store(self, seq: _Seq, session_id=None) -> None:
        """Hand the sequence's computed tokens to the tree (or free them with the cache off)."""
        creq = seq.creq
        if self.use_cache:
            if creq.num_tokens < seq.computed:  # their pages are there: no allocation
                self.cache.append_tokens(creq, seq.tokens[creq.num_tokens:seq.computed])
            self.cache.cache_finished(creq, session_id)
            self._detach(seq)
            if self.l3 is not None:
                self._write_through(seq)
        else:
            self.cache.release(creq)
            self._detach(seq)

    def _write_back_node(self, nd, ci: int) -> None:
        """The host tier is about to lose what node nd holds only there: its bytes are
        read now and written to L3 on the I/O thread (write_back)."""
        try:
            self._submit_write(self.l3.prepare_host_node(nd))
        except Exception:  # the host copy is lost either way; only L3 misses it
            log.exception("L3 write-back failed")
            self.counters["storage_errors"] += 1

    def _write_through(self, seq: _Seq) -> None:
        """The finished request's path goes to L3: the tree and the pools are read here
        (this thread owns them), the store is asked and written on the I/O thread."""
        if self.cache.host_evict_hook is not None:
            return  # write_back: L3 gets what the host tier evicts
        self.cache.sync_loads()  # the path may hold pages a load is still filling
        try:
            job = self.l3.prepare_cached(seq.tokens[:seq.computed], seq.req.salt, self.cache.write_min_hits)
        except Exception:  # the request is cached and done; the store only misses a write
            log.exception("L3 write-through for request %s failed", seq.req.rid)
            self.counters["storage_errors"] += 1
            return
        self._submit_write(job)

    def _submit_write(self, job) -> None:
        if job is None:
            return
        self._poll_writes()
        if len(self.writing) >= MAX_PENDING_WRITES:  # the store falls behind: this write is dropped
            self.counters["storage_writes_dropped"] += 1
            return
        if self._io_write is None:
            from concurrent.futures import ThreadPoolExecutor
            self._io_write = ThreadPoolExecutor(max_workers=1, thread_name_prefix="uniradix-l3-write")
        self.writing.append(self._io_write.submit(self.l3.commit, job))

    def _poll_writes(self, wait: bool = False) -> None:
        """Forget finished writes (commit counts its own outcome); with `wait`, first let
        every pending one finish."""
        if wait:
            for f in self.writing:
                f.exception()
        self.writing = [f for f in self.writing if not f.done()]

    def flush_writes(self) -> None:
        """Wait until every write-through and write-back handed to the I/O thread has
        reached the store (or failed, counted)."""
        self._poll_writes(wait=True)

    def _release(self, seq: _Seq) -> None:
        self.cache.release(self._detach(seq))

    # ------------------------------------------------------------------ admin
    def close_session(self, session_id) -> bool:
        return self.cache.close_session(session_id)

    def stats(self) -> dict:
        """Engine counters and the cache's own statistics."""
        c = dict(self.counters)
        c["hit_rate"] = c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
        c["waiting"] = len(self.waiting)
        c["running"] = len(self.running)
        c["cache"] = self.cache.stats()
        if self.l3 is not None:
            lc = dict(self.l3.counters)
            c["storage_loads"] = lc["loads"]
            c["storage_failed_loads"] = lc["failed_loads"]
            c["storage_saved_objects"] = lc["saved_objects"]
            # every failure counts: calls that raised, here or on the I/O threads, and sets refused
            c["storage_errors"] += lc["errors"] + lc["failed_sets"]
            c["storage_pending_writes"] = len(self.writing)
            c["storage"] = self.l3.stats()
        return c


def _check_device(device) -> torch.device:
    """cpu, or a CUDA device torch can see; anything else (a typo, meta, a device with
    no kernels here) is a ValueError naming --device."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a device torch knows: use cpu or cuda[:N]") from None
    if d.type == "cpu":
        return d
    if d.type != "cuda":
        raise ValueError(f"--device {device!r}: the engine runs on cpu or cuda[:N], not {d.type}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device!r} asked for, but torch sees no CUDA device")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return d


def _to(weights: dict, device: torch.device) -> dict:
    return {k: ([_to(x, device) for x in v] if isinstance(v, list) else
                _to(v, device) if isinstance(v, dict) else v.to(device))
            for k, v in weights.items()}
