"""The reference engine: scheduling only. Requests go match -> lock -> allocate ->
prefill from the safe boundary -> decode -> cache, with continuous batching, admission
control and preemption; the cache, its host tier and the storage tier do the rest.

Prefill and decode are one mechanism: a running request has `tokens` (prompt plus what
it generated) of which `computed` are in its pages and recurrent state; each step runs
the next chunk of the rest (one token when decoding) and samples when it reaches the
end. The recurrent state is captured (checkpoints) at the junction, at the prompt's
resume point (all but its last token, page-aligned: where the same prompt sent again
resumes) and, while decoding, at each page boundary; the window before the junction and
the resume point is kept, so the tree can resume later requests there."""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import replace

import torch

from ..cache import CacheFull, RequestState, audit
from ..config import EngineConfig
from ..model import ByteTokenizer, HybridConfig, PagedInput, init_weights, load_weights, paged_forward, preset
from ..tree.component import page_floor
from .build import build_cache
from .request import Request, SamplingParams
from .sampling import sample

log = logging.getLogger("uniradix.engine")


class Engine:
    """The reference hybrid model behind a UnifiedRadixCache.

    `config`: an EngineConfig, or its settings by name (SGLang's flag names:
    `page_size`, `max_total_tokens`, `chunked_prefill_size`, `enable_hierarchical_cache`,
    `hicache_storage_prefetch_policy`, ...; see uniradix.config for each, its default
    and what it allows). `weights`: a dict of tensors or a safetensors file (default:
    seeded). `storage`: a hicache StorageBackend shared with other engines (L3), closed
    by its owner. `submit` queues requests, `step` runs one scheduling step, `run` drives
    a list of requests to the end."""

    def __init__(self, model: HybridConfig | str = "tiny-hybrid", config: EngineConfig | None = None, *,
                 weights=None, storage=None, **settings) -> None:
        self.config = config = (config or EngineConfig()).with_(**settings) if settings else (config or EngineConfig())
        self.cfg = preset(model) if isinstance(model, str) else model
        sched = config.scheduler
        self.device = _check_device(sched.device)
        self.weights_path = None
        if weights is None:
            w = init_weights(self.cfg)
        elif isinstance(weights, dict):
            w = weights
        else:  # a safetensors file
            self.weights_path = os.fspath(weights)
            w = load_weights(self.cfg, self.weights_path)
        self.weights = _to(w, self.device)
        self.use_cache = not config.cache.disable_radix_cache
        host = config.host if self.use_cache else replace(config.host, enable_hierarchical_cache=False)
        self.cache, self.pools = build_cache(self.cfg, config.cache, host, device=self.device,
                                             max_running=sched.max_running_requests)
        self.hierarchical = self.cache.host is not None
        self.page_size = config.cache.page_size
        self.chunk = sched.chunked_prefill_size
        self.max_running = sched.max_running_requests
        self.captures = self.use_cache and self.cache.ckpt is not None  # checkpoints to take
        self.keeps_windows = self.use_cache and bool(self.cache.windowed)
        self.tokenizer = ByteTokenizer()
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.counters = dict(steps=0, finished=0, errors=0, preemptions=0, prefill_tokens=0, cached_tokens=0,
                             prompt_tokens=0, decode_tokens=0, checkpoints_skipped=0, host_tokens=0)
        self.storage = None
        if storage is not None:
            from ..hicache.l3 import StorageTier
            h = config.host
            weights_fp = self._weights_fingerprint() if config.storage.model_fingerprint is None else ""
            self.storage = StorageTier(self.cache, storage, config.storage, self.cfg, weights=weights_fp,
                                       write_policy=h.hicache_write_policy if self.hierarchical else "write_through",
                                       write_min_hits=h.write_min_hits)

    def _weights_fingerprint(self) -> str:
        """What the L3 namespace knows the weights by: a file's content digest (cached on
        disk by path, size and mtime, so a restart does not rehash it), else a digest of
        the tensors themselves."""
        from ..model.fingerprint import file_fingerprint, weights_fingerprint
        if self.weights_path is not None:
            return file_fingerprint(self.weights_path)
        return weights_fingerprint(self.weights)

    @property
    def prefetching(self) -> list[RequestState]:
        """Requests waiting for an L3 read (they hold their pages meanwhile)."""
        return [] if self.storage is None else [p[0] for p in self.storage.prefetching]

    def holders(self) -> list[RequestState]:
        """Every request that holds cache state now: running, or waiting for L3."""
        return list(self.running) + self.prefetching

    def audit(self, settled: bool = False) -> None:
        """Every handle owned exactly once (cache.audit); `settled`: no lock left either."""
        audit(self.cache, self.holders(), settled=settled)

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
            return req
        state = RequestState(list(ids), salt=req.salt, priority=req.priority, owner=req)
        seed = req.sampling.seed
        state.rng = None if seed is None else torch.Generator().manual_seed(seed)
        self.waiting.append(state)
        return req

    def _never_fits(self, req: Request) -> str | None:
        P = self.page_size
        L = len(req.input_ids)
        total = -(-(L + req.sampling.max_new_tokens) // P)
        for c, pool in zip(self.cache.page_comps, (self.cache.pools[c.index] for c in self.cache.page_comps)):
            n = total
            if c.window is not None:  # the prompt at once, then about two windows while decoding
                n = max(-(-L // P), min(total, 2 * -(-c.window // P) + 3))
            if n > pool.size:
                return (f"request {req.rid} can never fit: it needs {n} {c.name} pages "
                        f"({L} prompt + {req.sampling.max_new_tokens} new tokens at page size {P}) "
                        f"and the pool holds {pool.size}; raise --max-total-tokens or shorten the request")
        return None

    def _fail(self, req: Request, why: str) -> None:
        req.status = "error"
        req.error = why
        req.finish_reason = "error"
        req.metrics.finished = time.perf_counter()
        self.counters["errors"] += 1

    def _abort(self, st: RequestState, exc: BaseException, done: list[Request]) -> None:
        """Something failed inside a step because of this request (a bug, or a field
        changed after submit): it alone fails, its handles go back, and every other
        request goes on as if it had never been there."""
        req = st.owner
        log.error("request %s failed inside the engine: %s: %s", req.rid, type(exc).__name__, exc, exc_info=exc)
        for queue in (self.running, self.waiting):
            if st in queue:
                queue.remove(st)
        if self.storage is not None:
            self.storage.drop(st)
        if st.held:
            try:
                self.cache.release(st)
            except Exception:  # what it holds may leak; the engine keeps serving
                log.exception("request %s: its cache handles could not be returned", req.rid)
        self._fail(req, f"request {req.rid} failed: {type(exc).__name__}: {exc}")
        done.append(req)

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
        if self.storage is not None:
            self._start_prefetched(done)
            self.storage.poll_writes()
        self._admit(done)
        batch = self._schedule(done)
        if not batch and self.prefetching:
            self.storage.wait()
        if batch:
            self.counters["steps"] += 1
            for (st, inp), lg in zip(batch, self._forward(batch, done)):
                if lg is None:
                    continue
                try:
                    self._advance(st, inp, lg, done)
                except Exception as e:
                    self._abort(st, e, done)
        return done

    def _forward(self, batch: list, done: list[Request]) -> list:
        """Logits per batch entry. When the batched forward fails, each request runs alone
        so that only the one that fails is aborted (None in its place); the forward
        commits recurrent state only once it has run every layer, so a failed attempt
        leaves no request's state advanced."""
        cache = self.cache
        wait = cache.wait_layer if cache.pending_loads else None  # host loads still copying
        try:
            logits = paged_forward(self.cfg, self.weights, self.pools, [inp for _, inp in batch], wait_layer=wait)
        except Exception as e:
            if len(batch) == 1:
                logits = [None]
                self._abort(batch[0][0], e, done)
            else:
                logits = [self._forward_alone(st, inp, wait, done) for st, inp in batch]
        if wait is not None:
            cache.sync_loads()
        return logits

    def _forward_alone(self, st: RequestState, inp: PagedInput, wait, done: list[Request]):
        try:
            return paged_forward(self.cfg, self.weights, self.pools, [inp], wait_layer=wait)[0]
        except Exception as e:
            self._abort(st, e, done)
            return None

    # ------------------------------------------------------------------ admission
    def _admit(self, done: list[Request]) -> None:
        while self.waiting and len(self.running) + len(self.prefetching) < self.max_running:
            st = self.waiting[0]
            req = st.owner
            try:
                self._match(st)
            except CacheFull as e:
                if self.running or self.prefetching:
                    return  # it waits for admitted requests to free their pages
                self.waiting.popleft()
                self._fail(req, f"request {req.rid} can never fit: {e}")
                done.append(req)
                continue
            except Exception as e:
                self._abort(st, e, done)
                continue
            self.waiting.popleft()
            try:
                self.cache.zero_state(st)  # nothing to resume: the state starts from zeros
                if self.storage is not None and self.use_cache and self.storage.worth_reading(st):
                    self.storage.prefetch(st)
                    if req.status == "waiting":
                        req.status = "prefetching"
                    continue
                self._start(st, st.prefix_len)
            except Exception as e:
                self._abort(st, e, done)

    def _match(self, st: RequestState) -> None:
        """Match all but the last token, so at least one is computed and gives the
        logits to sample from, and allocate pages for all of them; all or nothing."""
        st.prompt_len = len(st.tokens)
        self.cache.match_prefix(st.tokens[:-1], st.salt, st.priority, alloc=True, state=st)
        try:
            self.cache.alloc_request(st, len(st.tokens))
        except CacheFull:
            self.cache.release(st)
            raise

    def _start_prefetched(self, done: list[Request]) -> None:
        for st, b in self.storage.poll():
            try:
                if isinstance(b, BaseException):
                    raise b
                self._start(st, b)
            except Exception as e:
                self._abort(st, e, done)

    def _start(self, st: RequestState, b: int) -> None:
        """The request resumes at b (its device boundary, or deeper from L3): running."""
        req = st.owner
        st.computed = b
        if req.status in ("waiting", "prefetching"):  # first admission, not a preempted one
            m = req.metrics
            m.cached_tokens, m.host_tokens, m.storage_tokens = b, st.host_tokens, b - st.prefix_len
            self.counters["host_tokens"] += st.host_tokens
            self.counters["cached_tokens"] += b
            self.counters["prompt_tokens"] += len(st.tokens)
        req.status = "running"
        P = self.page_size
        # the same prompt sent again matches all but its last token: it resumes here
        end = page_floor(st.prompt_len - 1, P)
        if end > b and (self.keeps_windows or self.captures):
            st.resume_points.append(end)
        if self.captures:
            for pos in {page_floor(st.junction, P), end}:
                if pos > b:
                    self._checkpoint(st, pos)
        self.running.append(st)

    def _checkpoint(self, st: RequestState, pos: int) -> int | None:
        """A slot to capture the state at pos; skipped (None) when the pool is short,
        since a checkpoint only saves later work."""
        try:
            return self.cache.add_checkpoint(st, pos)
        except CacheFull:
            self.counters["checkpoints_skipped"] += 1
            return None

    # ------------------------------------------------------------------ scheduling
    def _schedule(self, done: list[Request]) -> list[tuple[RequestState, PagedInput]]:
        budget = self.chunk
        batch = []
        for st in list(self.running):
            if st not in self.running:
                continue  # preempted to make room for an earlier one
            n = len(st.tokens) - st.computed
            if n > 1:  # prefill, within the step's token budget
                n = min(n, budget)
                if n == 0:
                    continue
                budget -= n
            try:
                if n == 1 and not self._grow(st, done):
                    continue
                batch.append((st, self._input(st, n)))
            except Exception as e:
                self._abort(st, e, done)
        return batch

    def _grow(self, st: RequestState, done: list[Request]) -> bool:
        """Pages for the token a decoding request is about to compute. On a shortfall the
        newest decoding request is preempted (its work is cached, it re-queues at the
        front) until this one fits; False when this one was preempted itself."""
        while True:
            try:
                if st.allocated < len(st.tokens):
                    self.cache.append_tokens(st, st.tokens[st.allocated:])
                return True
            except CacheFull:
                victim = next((s for s in reversed(self.running) if s.allocated <= s.computed), st)
                if victim is st and len(self.running) == 1 and not self.prefetching:
                    self.running.remove(st)
                    self.cache.release(st)
                    self._fail(st.owner, f"request {st.owner.rid} can never fit: the pools cannot "
                                         f"hold {len(st.tokens)} tokens")
                    done.append(st.owner)
                    return False
                self._preempt(victim, done)
                if victim is st:
                    return False

    def _preempt(self, st: RequestState, done: list[Request]) -> None:
        self.running.remove(st)
        try:
            self._store(st)
        except Exception as e:
            self._abort(st, e, done)
            return
        st.clear()
        st.owner.status = "preempted"
        st.owner.metrics.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(st)

    def _input(self, st: RequestState, n: int) -> PagedInput:
        s, e, P = st.computed, st.computed + n, self.page_size
        if self.captures and P > 1 and e >= st.prompt_len and e % P == 0 and e not in st.checkpoints:
            # the rolling decode checkpoint moves to each page boundary it passes
            if st.rolling is not None:
                st.checkpoints[e] = st.checkpoints.pop(st.rolling)
                st.rolling = e
            elif self._checkpoint(st, e) is not None:
                st.rolling = e
        return PagedInput(st.tokens[s:e], s, st.pages, st.state_slot, st.captures(s, e))

    # ------------------------------------------------------------------ after the forward
    def _advance(self, st: RequestState, inp: PagedInput, logits: torch.Tensor, done: list[Request]) -> None:
        req = st.owner
        n = len(inp.tokens)
        prefill = min(st.computed + n, st.prompt_len) - min(st.computed, st.prompt_len)
        req.metrics.computed_tokens += prefill
        self.counters["prefill_tokens"] += prefill
        self.counters["decode_tokens"] += n - prefill
        st.computed += n
        if self.cache.windowed:
            self.cache.release_out_of_window(st, st.computed)
        if st.computed < len(st.tokens):
            return
        row = logits[-1]
        if req.record_logits:
            req.logits.append(row.detach().to("cpu", copy=True))
        tok = sample(row, req.sampling, st.rng)
        now = time.perf_counter()
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        req.output_ids.append(tok)
        st.tokens.append(tok)
        req.metrics.output_tokens = len(req.output_ids)
        if tok in req.sampling.stop_ids:
            req.finish_reason = "stop"
        elif len(req.output_ids) >= req.sampling.max_new_tokens:
            req.finish_reason = "length"
        else:
            return
        self.running.remove(st)
        self._store(st, req.session_id)
        req.status = "finished"
        req.metrics.finished = now
        self.counters["finished"] += 1
        done.append(req)

    def _store(self, st: RequestState, session_id=None) -> None:
        """Hand the request's computed tokens to the tree (or free them with the cache off)."""
        if not self.use_cache:
            self.cache.release(st)
            return
        if st.allocated < st.computed:  # their pages are there: no allocation
            self.cache.append_tokens(st, st.tokens[st.allocated:st.computed])
        self.cache.cache_finished(st, session_id)
        if self.storage is not None:
            self.storage.write_through(st)

    # ------------------------------------------------------------------ admin
    def flush_writes(self) -> None:
        """Wait until every L3 write handed to the I/O thread has reached the store (or
        failed, counted)."""
        if self.storage is not None:
            self.storage.poll_writes(wait_all=True)

    def close(self) -> None:
        """Stop the I/O threads and wait for host loads (the store itself belongs to the
        caller)."""
        self.cache.sync_loads()
        if self.storage is not None:
            self.storage.close()

    def close_session(self, session_id) -> bool:
        return self.cache.close_session(session_id)

    def stats(self) -> dict:
        """Engine counters and the cache's own statistics."""
        c = dict(self.counters)
        c["hit_rate"] = c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
        c["waiting"] = len(self.waiting)
        c["running"] = len(self.running)
        c["cache"] = self.cache.stats()
        from ..hicache.l3 import StorageTier
        c.update(self.storage.stats() if self.storage is not None else StorageTier.IDLE)
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
