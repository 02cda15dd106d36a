"""Shared checks for the engine tests: exactness against the no-cache oracle, and
exact ownership of every pool handle (free list, a running request, or the tree).

Imported as a plain module: pytest puts tests/engine on sys.path for its test files.
"""
from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path

import torch

from uniradix.engine import Engine, Request, SamplingParams
from uniradix.model import PRESETS, reference_forward
from uniradix.tree.component import page_floor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tree"))
from helpers import held  # noqa: E402  (tests/tree: handles the tree holds, per component)

PRESET_NAMES = list(PRESETS)
PAGE_SIZES = (1, 4, 16)
TOL = 1e-4

__all__ = ["PRESET_NAMES", "PAGE_SIZES", "TOL", "Engine", "Request", "SamplingParams", "page_floor",
           "toks", "diverging", "greedy", "check_exact", "check_work", "tree_nodes", "tree_handles",
           "check_ownership", "check_host_ownership", "check_settled", "check_flush", "run_checked",
           "has_kind"]


def has_kind(name: str, kind: str) -> bool:
    return kind in PRESETS[name].pattern


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def diverging(rng: random.Random, n: int, avoid) -> list[int]:
    """n random tokens whose first is none of `avoid` (so a branch really diverges there)."""
    avoid = set(avoid)
    first = rng.choice([t for t in range(256) if t not in avoid])
    return [first] + toks(rng, n - 1)


def greedy(ids, n: int, **kw) -> Request:
    return Request(input_ids=list(ids), sampling=SamplingParams(max_new_tokens=n, **kw), record_logits=True)


def check_exact(engine: Engine, req: Request) -> None:
    """Each recorded logits row equals the oracle's row over prompt + output[:-1], and
    greedy decoding picked exactly the oracle's argmax."""
    assert req.status == "finished", (req.status, req.error)
    prompt, out = list(req.input_ids), list(req.output_ids)
    assert out, "a finished request produced nothing"
    assert len(req.logits) == len(out), (len(req.logits), len(out))
    ref = reference_forward(engine.cfg, engine.weights, prompt + out[:-1])[len(prompt) - 1:]
    got = torch.stack([row.float() for row in req.logits])
    assert got.shape == ref.shape, (got.shape, ref.shape)
    diff = (got - ref.to(got.dtype)).abs().max().item()
    assert diff < TOL, f"request {req.rid}: logits differ from the oracle by {diff}"
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


def tree_handles(tree) -> dict[str, Counter]:
    tree_nodes(tree)  # the structure check
    return held(tree)


def _holders(engine: Engine) -> list:
    """Sequences that own cache state: running ones, and those waiting for an L3 read."""
    return list(engine.running) + [seq for seq, _, _ in engine.prefetching]


def _request_handles(engine: Engine):
    """(handles each running request owns, handles of the tree each one reads) per pool."""
    own = {name: Counter() for name in engine.pools}
    reads = {name: Counter() for name in engine.pools}
    P = engine.page_size
    for seq in _holders(engine):
        creq = seq.creq
        assert creq is not None, "a running sequence lost its cache request"
        cut = creq.prefix_len // P
        for name, pages in creq.pages.items():
            reads[name].update(int(h) for h in pages[:cut] if h >= 0)
            own[name].update(int(h) for h in pages[cut:] if h >= 0)
        if "mamba" in engine.pools:
            if creq.state_slot is not None:
                own["mamba"][creq.state_slot] += 1
            own["mamba"].update(creq.checkpoints.values())
    for seq in engine.waiting:
        assert seq.creq is None, "a waiting sequence holds cache state"
    return own, reads


def check_ownership(engine: Engine) -> None:
    """DESIGN §3 'accounting is exact', checked at any point between steps: every
    allocated handle of every pool is held exactly once, by the tree or by one running
    request; what a running request reads from the tree is still there (nothing locked
    was evicted)."""
    tree = engine.cache.tree
    held = tree_handles(tree)
    own, reads = _request_handles(engine)
    for name, pool in engine.pools.items():
        h, o = held[name], own[name]
        dup = [x for x, k in (h + o).items() if k > 1]
        assert not dup, f"{name}: handles owned twice (tree and/or requests): {sorted(dup)[:10]}"
        total = sum(h.values()) + sum(o.values())
        assert pool.size - pool.available == total, \
            f"{name}: {pool.size - pool.available} handles allocated, the tree holds {sum(h.values())} " \
            f"and running requests {sum(o.values())}: leak or double free"
        for x in list(h) + list(o):
            assert pool.is_allocated(x), f"{name}: handle {x} is owned but free in the pool"
        gone = set(reads[name]) - set(h)
        assert not gone, f"{name}: tree pages a running request reads were evicted: {sorted(gone)[:10]}"
    ti = tree.index
    for name in engine.pools:
        assert tree.size[ti[name]] == sum(held[name].values()), (name, tree.size, held[name])
    check_host_ownership(engine)


def host_held(tree) -> dict[str, Counter]:
    out = {c.name: Counter() for c in tree.components}
    for nd in tree.nodes():
        for c in tree.components:
            v = nd.host[c.index]
            if v is not None:
                out[c.name].update(v)
        assert any(v is not None for v in (nd.value[0], nd.host[0])), f"{nd}: FULL in no tier"
    return out


def check_host_ownership(engine: Engine) -> None:
    """The host tier: every allocated host handle is held exactly once, by the tree or by
    a running request (pages it read from L3 through the host, until it is cached)."""
    cache = engine.cache
    if cache.host_pools is None:
        return
    tree = cache.tree
    held = host_held(tree)
    staged = {c.name: Counter() for c in tree.components}
    for seq in _holders(engine):
        for ci, pages in (seq.creq.staged or {}).items():
            if ci < 0:
                staged[tree.components[cache.ckpt.index].name].update(pages)
            else:
                staged[tree.components[ci].name].update(h for _, h in pages.values())
    for c, hp in zip(tree.components, cache.host_pools):
        assert tree.host_size[c.index] == sum(held[c.name].values())
        h = held[c.name] + staged[c.name]
        dup = [x for x, k in h.items() if k > 1]
        assert not dup, f"host {c.name}: handles held twice: {sorted(dup)[:10]}"
        assert hp.size - hp.available == sum(h.values()), \
            f"host {c.name}: {hp.size - hp.available} allocated, the tree holds {sum(h.values())}"


def check_settled(engine: Engine) -> None:
    """After every request finished: nothing running or waiting, no lock left anywhere,
    and every allocated handle belongs to the tree."""
    assert not engine.running and not engine.waiting
    tree = engine.cache.tree
    assert list(tree.locked) == [0] * tree.nc, f"locks left after the run: {tree.locked}"
    for nd in tree_nodes(tree):
        assert not any(nd.locks), f"a lock was left on {nd}"
    check_ownership(engine)


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
