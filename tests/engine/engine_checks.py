"""Shared checks for the engine tests: exactness against the no-cache oracle, and
exact ownership of every pool handle (free list, a running request, or the tree).

Imported as a plain module: pytest puts tests/engine on sys.path for its test files.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

from uniradix.engine import Engine, Request, SamplingParams
from uniradix.model import PRESETS, reference_forward
from uniradix.tree.component import page_floor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tree"))
import helpers  # noqa: E402,F401  (tests/tree, on sys.path for the engine tests that use it)

PRESET_NAMES = list(PRESETS)
PAGE_SIZES = (1, 4, 16)
TOL = 1e-4

__all__ = ["PRESET_NAMES", "PAGE_SIZES", "TOL", "Engine", "Request", "SamplingParams", "page_floor",
           "SPECULATE", "GreedyDrafter", "speculating",
           "toks", "diverging", "greedy", "check_exact", "check_work", "tree_nodes",
           "check_ownership", "check_host_ownership", "check_settled", "check_flush", "run_checked",
           "has_kind"]


def has_kind(name: str, kind: str) -> bool:
    return kind in PRESETS[name].pattern


def full_budget(model, full_tokens: int, page_size: int = 1, **settings) -> int:
    """--max-total-tokens for a FULL pool of at most `full_tokens` tokens: the KV budget is
    split (engine.build.kv_split), and FULL gets what the window pools leave of it, so a
    test that sizes FULL to press it asks for the budget that leaves it this much.
    `settings`: the other cache settings (swa_full_tokens_ratio, ...) and max_running /
    chunk as the engine gets them."""
    from uniradix.config import CacheConfig, SchedulerConfig
    from uniradix.engine.build import kv_split
    from uniradix.model import load_model
    m = load_model(model) if isinstance(model, str) else model
    sched = SchedulerConfig()
    split = {"max_running": settings.pop("max_running", sched.max_running_requests),
             "chunk": settings.pop("chunk", sched.chunked_prefill_size)}
    best = page_size
    for t in range(page_size, full_tokens + page_size, page_size):
        try:
            sizes = kv_split(m, CacheConfig(page_size=page_size, max_total_tokens=t, **settings), **split).sizes
        except ValueError:  # too small a budget for a window pool
            continue
        if sizes["full"][0] * page_size > full_tokens:
            break
        best = t
    return best


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def diverging(rng: random.Random, n: int, avoid) -> list[int]:
    """n random tokens whose first is none of `avoid` (so a branch really diverges there)."""
    avoid = set(avoid)
    first = rng.choice([t for t in range(256) if t not in avoid])
    return [first] + toks(rng, n - 1)


def greedy(ids, n: int, **kw) -> Request:
    return Request(input_ids=list(ids), sampling=SamplingParams(max_new_tokens=n, **kw), record_logits=True)


#: the engine settings that turn speculation on (drafts made by the tests' own drafters)
SPECULATE = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3)


class GreedyDrafter:
    """Drafts that a greedy verify keeps for a known count, then does not: the model's own
    next tokens (its no-cache forward's argmax: the engine's greedy choice, bit for bit)
    for the first `right` of `k`, then tokens one past the last (wrong, as a rule). `right`
    cycles 0 .. k over the calls, so every position of a chunk is kept and rejected in
    turn. Set as an engine's `_drafts`."""

    def __init__(self, engine: Engine, k: int = 3) -> None:
        self.engine, self.k, self.calls = engine, k, 0

    def __call__(self, st) -> list[int]:
        req = st.owner
        room = req.sampling.max_new_tokens - len(req.output_ids) - 1
        if room <= 0 or req.sampling.temperature:
            return []
        right = self.calls % (self.k + 1)
        self.calls += 1
        toks, out = list(st.tokens), []
        for i in range(min(self.k, room)):
            if i < right:
                t = int(self.engine.model.reference(toks)[-1].argmax())
            else:
                t = (toks[-1] + 1) % self.engine.model.vocab_size
            out.append(t)
            toks.append(t)
        return out


def speculating(engine: Engine) -> Engine:
    """`engine` (made with SPECULATE) drafting with a GreedyDrafter."""
    engine._drafts = GreedyDrafter(engine, engine.spec.speculative_num_draft_tokens)
    return engine


def check_exact(engine: Engine, req: Request, oracle=None, tol: float = TOL) -> None:
    """Each recorded logits row equals the oracle's row over prompt + output[:-1], and
    greedy decoding picked exactly the oracle's argmax. `oracle(tokens) -> logits`:
    default the model's own no-cache forward, which the engine equals bit for bit where
    the row-invariant kernels run (model/kernels); another oracle (transformers' for
    real checkpoints) computes otherwise, so within `tol`."""
    from uniradix.model import kernels
    assert req.status == "finished", (req.status, req.error)
    prompt, out = list(req.input_ids), list(req.output_ids)
    assert out, "a finished request produced nothing"
    assert len(req.logits) == len(out), (len(req.logits), len(out))
    own = oracle is None
    oracle = oracle or engine.model.reference
    ref = oracle(prompt + out[:-1])[len(prompt) - 1:]
    if own and kernels.available() and engine.device.type == "cpu":
        got = torch.stack(list(req.logits)).to(ref.dtype)
        assert got.shape == ref.shape, (got.shape, ref.shape)
        differ = (got != ref).any(-1).nonzero().flatten().tolist()
        assert not differ, (f"request {req.rid}: logits rows {differ[:8]} differ from the no-cache forward's "
                            f"(max {(got.double() - ref.double()).abs().max().item():.3g})")
        if req.sampling.temperature == 0:
            assert ref.argmax(-1).tolist() == out, f"request {req.rid}: greedy tokens differ from the oracle"
        return
    got = torch.stack([row.double() for row in req.logits])
    assert got.shape == ref.shape, (got.shape, ref.shape)
    diff = (got - ref.double()).abs().max().item()
    assert diff < tol, f"request {req.rid}: logits differ from the oracle by {diff}"
    if req.sampling.temperature == 0:
        assert ref.argmax(-1).tolist() == out, f"request {req.rid}: greedy tokens differ from the oracle"


def check_work(req: Request) -> None:
    """A request that was never preempted computes exactly the prompt tokens past its boundary."""
    m = req.metrics
    assert m.prompt_tokens == len(req.input_ids)
    assert 0 <= m.cached_tokens <= m.prompt_tokens - 1  # the last prompt token is always computed
    assert m.output_tokens == len(req.output_ids)
    if m.preemptions == 0:
        assert m.computed_tokens == m.prompt_tokens - m.cached_tokens, (m, req.rid)
    else:
        assert m.computed_tokens >= m.prompt_tokens - m.cached_tokens, (m, req.rid)


# --------------------------------------------------------------------------- ownership
def tree_nodes(tree):
    """Every attached node under every root (roots excluded), with a structure check."""
    out = tree.nodes()
    for nd in out:
        assert nd.attached, nd
    return out


def check_ownership(engine: Engine) -> None:
    """design.md §3 'accounting is exact', checked at any point between steps by the
    library's audit (uniradix.cache.audit): every allocated handle of every pool, in both
    tiers, is held exactly once, by the tree or by one running request; what a running
    request reads from the tree is still there (nothing locked was evicted)."""
    for st in engine.waiting:
        assert not st.held, "a waiting request holds cache state"
    engine.audit()


def check_host_ownership(engine: Engine) -> None:
    """The host tier's part of the audit (check_ownership covers it too)."""
    engine.audit()


def check_settled(engine: Engine) -> None:
    """After every request finished: nothing running or waiting, no lock left anywhere,
    and every allocated handle belongs to the tree."""
    assert not engine.running and not engine.waiting
    engine.audit(settled=True)


def check_flush(engine: Engine) -> None:
    """Flushing a settled engine gives every handle back to its pool."""
    assert engine.cache.flush() is True
    for name, pool in engine.pools.items():
        assert pool.available == pool.size, f"{name}: {pool.size - pool.available} handles still allocated after flush"
    assert engine.cache.tree.num_nodes == 0
    assert not tree_nodes(engine.cache.tree)
    assert list(engine.cache.tree.size) == [0] * engine.cache.tree.nc
    for hp in engine.cache.host_pools or ():
        assert hp.available == hp.size, f"host {hp.name}: {hp.size - hp.available} handles still allocated after flush"


def swa_held(engine: Engine, name: str = "swa") -> int:
    """The window pages running requests hold: their own and what their locks pin in
    the tree (its unlocked pages, the spare windows a prompt left behind above all, go
    to whoever needs them)."""
    pool = engine.pools[name]
    return pool.size - pool.available - engine.cache.tree.evictable(name)


def run_checked(engine: Engine, requests, *, every_step: bool = True) -> dict:
    """Submit and step to the end, checking ownership after every step; returns what
    was seen on the way (the most requests in flight together, steps, mixed batches)."""
    for r in requests:
        engine.submit(r)
    seen = dict(max_running=0, max_waiting=0, steps=0)
    while engine.waiting or engine.running or engine.prefetching:
        engine.step()
        seen["steps"] += 1
        seen["max_running"] = max(seen["max_running"], len(engine.running))
        seen["max_waiting"] = max(seen["max_waiting"], len(engine.waiting))
        if every_step:
            check_ownership(engine)
        assert seen["steps"] < 10_000, "the engine does not make progress"
    engine.flush_writes()  # as Engine.run: over once its L3 writes have reached the store
    return seen
