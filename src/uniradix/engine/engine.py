"""The reference engine: scheduling only. Requests go match -> lock -> allocate ->
prefill from the safe boundary -> decode -> cache, with continuous batching, admission
control and preemption; the cache, its host tier and the storage tier do the rest.

Prefill and decode are one mechanism: a running request has `tokens` (prompt plus what
it generated) of which `computed` are in its pages and recurrent state; each step runs
the next chunk of the rest (one token when decoding) and samples when it reaches the
end. The recurrent state is captured (checkpoints) at the junction, at the prompt's
resume point (all but its last token, page-aligned: where the same prompt sent again
resumes) and, while decoding, at each page boundary; the window before the junction and
the resume point is kept, so the tree can resume later requests there. Requests that
arrive together and share a prefix the cache lacks compute it once: the later ones wait
for the first to put it in the tree (admission.py)."""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import replace

import torch

from ..cache import RequestState, audit
from ..config import EngineConfig
from ..model import HybridConfig, PagedModel, load_model  # noqa: F401  (PagedModel: the annotation)
from .admission import Admission
from .batching import Batching
from .build import build_cache
from .request import Request, SamplingParams
from .speculation import Speculation

log = logging.getLogger("uniradix.engine")


class Engine(Admission, Batching, Speculation):
    """A model behind a UnifiedRadixCache.

    `model`: a PagedModel, a preset name or HybridConfig of the embedded model (with
    `weights`: a dict of tensors or a safetensors file; default seeded), or a checkpoint
    directory / .gguf file. `config`: an EngineConfig, or its settings by name (SGLang's
    flag names: `page_size`, `max_total_tokens`, `chunked_prefill_size`,
    `enable_hierarchical_cache`, `hicache_storage_prefetch_policy`, ...; see
    uniradix.config for each, its default and what it allows). `storage`: a hicache
    StorageBackend shared with other engines (L3), closed by its owner. `submit` queues
    requests, `step` runs one scheduling step, `run` drives a list of requests to the end.
    `accounting_only`: pools that count and hold nothing, for a model that computes
    nothing (engine.replay).

    Every setting given takes effect or is refused (ValueError): a tier's settings
    without that tier (EngineConfig.check_in_effect), and `hicache_storage_backend`
    builds its backend here as `uniradix serve` does (hicache.backends.open_backend: an
    unreachable store is StorageUnavailable unless allow_unavailable_at_start), closed
    by `close`; given `storage` too, it is refused (which store would it be?)."""

    def __init__(self, model: "PagedModel | HybridConfig | str" = "tiny-hybrid",
                 config: EngineConfig | None = None, *, weights=None, storage=None, accounting_only: bool = False,
                 **settings) -> None:
        self.config = config = (config or EngineConfig()).with_(**settings) if settings else (config or EngineConfig())
        backend_name = config.storage.hicache_storage_backend
        if storage is not None and backend_name:
            raise ValueError(f"a storage backend ({type(storage).__name__}) and hicache_storage_backend="
                             f"{backend_name!r} are both given: give one")
        config.check_in_effect(store=storage is not None or bool(backend_name))
        sched = config.scheduler
        self.device = _check_device(sched.device)
        self.model = load_model(model, weights).to(self.device)
        self.context_length = _context_length(sched, self.model.context_length)
        self.cfg, self.weights = self.model.config, self.model.weights
        self.use_cache = not config.cache.disable_radix_cache
        host = config.host if self.use_cache else replace(config.host, enable_hierarchical_cache=False)
        self.cache, self.pools = build_cache(self.model, config.cache, host, device=self.device,
                                             max_running=sched.max_running_requests,
                                             chunk=sched.chunked_prefill_size, context_length=self.context_length,
                                             accounting_only=accounting_only)
        self.hierarchical = self.cache.host is not None
        self.page_size = config.cache.page_size
        self.chunk = sched.chunked_prefill_size
        self.max_running = sched.max_running_requests
        self.captures = self.use_cache and self.cache.ckpt is not None  # checkpoints to take
        self.keeps_windows = self.use_cache and bool(self.cache.windowed)
        self.tokenizer = self.model.tokenizer
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.counters = dict(steps=0, finished=0, errors=0, aborted=0, preemptions=0, prefill_tokens=0, cached_tokens=0,
                             prompt_tokens=0, decode_tokens=0, checkpoints_skipped=0, host_tokens=0,
                             storage_tokens=0, storage_cross_instance_tokens=0, shared_prefixes=0,
                             spec_verify_steps=0, spec_draft_tokens=0, spec_accepted_tokens=0, spec_no_room=0)
        self.spec = config.speculative if config.speculative.on else None
        if self.spec is not None and "SUFFIX" in self.spec.speculative_algorithm:
            from ..tree.drafts import DraftIndex
            self.cache.tree.drafts = DraftIndex()  # kept in step with the tree from its first insert
        #: drafts accepted at each position of a verify chunk (vLLM's accepted tokens per position)
        self.spec_accepted_at = [0] * (self.spec.speculative_num_draft_tokens if self.spec else 0)
        self.draft_bar = 0.0  # the chance of being kept a draft needs this step (speculation.draft_bar)
        self.draft_room = 0  # the drafts the request being drafted for may have this step (its share)
        self.holding = 0  # waiting requests held at the last admission for a prefix a running one computes
        self._queued = itertools.count(1)  # the order requests were queued in (in-batch sharing is FIFO)
        self.storage = None
        self._own_backend = None  # the backend built here from the settings: closed by close()
        if backend_name:  # last: a mistake above builds nothing to close
            from ..hicache.backends import open_backend
            storage = self._own_backend = open_backend(config.storage)
        if storage is not None:
            try:
                self._storage_tier(storage)
            except BaseException:
                self.close_backend()
                raise

    def _storage_tier(self, storage) -> None:
        from ..hicache.l3 import StorageTier
        config, h = self.config, self.config.host
        named = config.storage.model_fingerprint is not None  # the fleet names the model, not its weights
        weights_fp = "" if named else self._weights_fingerprint()
        self.storage = StorageTier(self.cache, storage, config.storage, self.model.config, weights=weights_fp,
                                   write_policy=h.hicache_write_policy if self.hierarchical else "write_through",
                                   write_min_hits=h.write_min_hits, witness=self._witness(whole=named))

    def _weights_fingerprint(self) -> str:
        """What the L3 namespace knows the weights by: a file's content digest (cached on
        disk by path, size and mtime, so a restart does not rehash it), else a digest of
        the tensors themselves."""
        from ..model.fingerprint import file_fingerprint, weights_fingerprint
        if self.model.files:
            return file_fingerprint(list(self.model.files))
        return weights_fingerprint(self.weights)

    def _witness(self, whole: bool) -> str:
        """What the L3 namespace checks the model by, whatever names it (see
        hicache.witness): its computation and its loaded tensors, every byte of them
        where a fleet's model_fingerprint names the namespace (it says nothing of the
        weights or the config), else a few fixed elements (the name carries the
        checkpoint's digest and config; the witness adds the dtype and quantization), and
        the kernels' arithmetic in the model's dtype (kernels.identity: KV another computes
        differs in bits)."""
        from ..model import kernels
        from ..model.fingerprint import model_witness
        return model_witness(self.weights, {**self.model.computation(), "kernels": kernels.identity(getattr(self.model, "dtype", None))},
                             whole)

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
        """Queue a request. Malformed input raises ValueError; a request longer than the
        context or that the pools could never hold finishes at once with status "error"
        and says why."""
        why = self.prepare(req)
        if why:
            self._fail(req, why)
            return req
        return self.enqueue(req)

    def prepare(self, req: Request) -> str | None:
        """Check a new request and tokenize its text; returns why it could never fit (past
        the context length, or past the pools), or None; a default count is shortened to
        the context here. Reads nothing that a step changes, so a server may call it on
        its own thread before handing the request to the scheduler's (`enqueue`)."""
        if req.status != "new":
            raise ValueError(f"request {req.rid} was already submitted")
        ids = req.check(self.model.vocab_size)
        if req.text is not None:
            ids = self.tokenizer.encode(req.text)
            if ids and max(ids) >= self.model.vocab_size:  # a tokenizer that does not match the model
                bad = sorted({t for t in ids if t >= self.model.vocab_size})[:5]
                raise ValueError(f"request {req.rid}: the tokenizer gave token ids {bad} past the model's "
                                 f"vocabulary of {self.model.vocab_size}: the checkpoint's tokenizer does not "
                                 f"match its config")
        if not ids:
            raise ValueError(f"request {req.rid} has an empty prompt")
        if req.prompt_logprobs_from is not None and req.prompt_logprobs_from >= len(ids):
            raise ValueError(f"request {req.rid}: prompt_logprobs_from {req.prompt_logprobs_from} is past the "
                             f"prompt's {len(ids)} tokens")
        req.input_ids = ids
        req.metrics.prompt_tokens = len(ids)
        return self._over_context(req) or self._never_fits(req)

    def enqueue(self, req: Request) -> Request:
        """Queue a prepared request (the scheduler's thread)."""
        ids = req.input_ids
        req.status = "waiting"
        state = RequestState(list(ids), salt=req.salt, priority=req.priority, owner=req)
        seed = req.sampling.seed
        state.rng = None if seed is None else torch.Generator().manual_seed(seed)
        state.order = next(self._queued)
        self.waiting.append(state)
        return req

    def _over_context(self, req: Request) -> str | None:
        """Why the request spans more than the context (prompt L plus n new tokens must
        have L + n <= context), or None. A default count the client did not choose
        (`fit_context`) is shortened to the room left instead; only a prompt that leaves
        no room for one token is refused then."""
        C = self.context_length
        L, n = len(req.input_ids), req.sampling.max_new_tokens
        if C is None or L + n <= C:
            return None
        where = ("the model's context length" if self.config.scheduler.context_length is None
                 else "the context length (--context-length)")
        if L >= C:
            return (f"request {req.rid} is too long: its {L} prompt tokens leave no room for a new token "
                    f"in {where} of {C} tokens")
        if req.sampling.fit_context:
            req.sampling = replace(req.sampling, max_new_tokens=C - L)
            return None
        return (f"request {req.rid} is too long: {L} prompt tokens + {n} max_new_tokens = {L + n} tokens, "
                f"more than {where} of {C} tokens")

    def _never_fits(self, req: Request) -> str | None:
        P = self.page_size
        L = len(req.input_ids)
        total = -(-(L + req.sampling.max_new_tokens) // P)
        for c, pool in zip(self.cache.page_comps, (self.cache.pools[c.index] for c in self.cache.page_comps)):
            n = total
            if c.window is not None:  # at most two windows and a page: prefill takes them chunk by chunk
                n = min(total, 2 * -(-c.window // P) + 3)
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
        self._drop(st)
        self._fail(req, f"request {req.rid} failed: {type(exc).__name__}: {exc}")
        done.append(req)

    def _drop(self, st: RequestState) -> None:
        """Take a request out of every queue and give back all it holds; nothing more of
        it is cached (cache.release)."""
        for queue in (self.running, self.waiting):
            if st in queue:
                queue.remove(st)
        if self.storage is not None:
            self.storage.drop(st)
        if st.held:
            try:
                self.cache.release(st)
            except Exception:  # what it holds may leak; the engine keeps serving
                log.exception("request %s: its cache handles could not be returned", st.owner.rid)

    def abort(self, req: Request, why: str = "aborted") -> bool:
        """Cancel a request that has not finished (its client went away): it leaves its
        queue and its pages, state slots and locks go back at once; the prefix it matched,
        and what of its prompt it had already put in the tree, stay cached. False when it
        is not in this engine (never submitted, or done)."""
        st = next((s for s in (*self.running, *self.waiting, *self.prefetching) if s.owner is req), None)
        if st is None or req.done:
            return False
        self._drop(st)
        req.status, req.finish_reason, req.error = "aborted", "abort", why
        req.metrics.finished = time.perf_counter()
        self.counters["aborted"] += 1
        return True

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

    # ------------------------------------------------------------------ admission

    # ------------------------------------------------------------------ scheduling

    # ------------------------------------------------------------------ after the forward

    # ------------------------------------------------------------------ admin
    def flush_writes(self, timeout: float | None = None) -> bool:
        """Wait until every L3 write handed to the I/O thread has reached the store (or
        failed, counted), for at most `timeout` seconds (default: the storage tier's
        io_timeout). True when none is left pending."""
        if self.storage is not None:
            return self.storage.poll_writes(wait_all=True, timeout=timeout)
        return True

    def close(self, timeout: float | None = None) -> None:
        """The graceful end: write down to L3 what the store lacks of the cache (as a
        flush does, whatever the write policy: write_back data held only by the device
        and host tiers would be lost), then stop the I/O threads (the write-down and the
        pending writes get at most `timeout` seconds together, default the storage tier's
        io_timeout) and wait for host loads; the backend too, in what is left of that
        time, when this engine built it (one given to it belongs to the caller)."""
        self.cache.sync_loads()
        if self.storage is not None:
            t = self.storage.io_timeout if timeout is None else max(timeout, 0.0)
            end = time.monotonic() + t
            if self.use_cache:
                self.storage.write_down(t)
            self.storage.close(max(0.0, end - time.monotonic()))
            self.cache.lower = None  # a later flush has no store to write to
            self.close_backend(max(0.0, end - time.monotonic()))

    def close_backend(self, timeout: float | None = None) -> bool:
        """Close the L3 backend this engine built from its settings (one given to it is
        its owner's), once, waiting at most `timeout` seconds (default io_timeout): a
        close that hangs in a store that stopped answering is left behind, logged.
        False when that happened."""
        backend, self._own_backend = self._own_backend, None
        if backend is None:
            return True
        from ..hicache.io_threads import call_within
        t = self.config.storage.io_timeout if timeout is None else timeout
        if call_within(backend.close, t):
            return True
        log.warning("closing the L3 backend did not end within the graceful timeout: left behind")
        return False

    def close_session(self, session_id, salt=None) -> bool:
        """Drop the cache references of session `session_id` of the tenant `salt` (the
        salt its requests were given: another salt's session of that id is another)."""
        return self.cache.close_session(session_id, salt)

    def stats(self) -> dict:
        """Engine counters and the cache's own statistics."""
        c = dict(self.counters)
        c["hit_rate"] = c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
        c["spec_accepted_per_pos"] = list(self.spec_accepted_at)
        c["waiting"] = len(self.waiting)
        c["holding"] = self.holding
        c["running"] = len(self.running)
        c["prefetching"] = len(self.prefetching)
        c["cache"] = self.cache.stats()
        from ..hicache.l3 import StorageTier
        c.update(self.storage.stats() if self.storage is not None else StorageTier.IDLE)
        return c


def _context_length(sched, own: int | None) -> int | None:
    """--context-length, else the model's own (None: unbounded). Longer than the
    model's own only with --allow-longer-context: positions past it were never trained,
    so serving them is the operator's explicit choice (SGLang asks for an environment
    variable; here it is a flag)."""
    asked = sched.context_length
    if asked is None:
        return own
    if own is not None and asked > own:
        if not sched.allow_longer_context:
            raise ValueError(f"--context-length {asked} is longer than the model's own context of {own} tokens; "
                             f"add --allow-longer-context to serve positions it was not trained on")
        log.warning("--context-length %d is longer than the model's own context of %d tokens "
                    "(--allow-longer-context): outputs past %d tokens may degrade", asked, own, own)
    return asked


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
