"""A new kind of state is one spec: this file defines one outside the package (a second
sliding window, as models with local layers of two sizes have) and runs it through the
whole stack, with no change to the engine, the cache, the tiers or the forward: the
tree gets a fourth component, its pool is built from the model's layers, its objects go
to L3 under their own name, and every token stays exact against the oracle in L1, L2
and L3. Beside it, the other layer shapes real models need: layers that keep nothing
(MLP only), a layer that keeps KV and a recurrent state, and recurrent states of
different shapes and dtypes per layer; and every mix of layer kinds, those with no
full-attention layer included, goes through every tier."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
from engine_checks import check_exact, full_budget, check_work, greedy, page_floor, run_checked, toks

from uniradix.engine import build_cache
from uniradix.hicache.backends.file import FileBackend
from uniradix.model import HybridConfig
from uniradix.specs import FullKV, LayerState, RecurrentShape, RecurrentState, SlidingWindowKV, group_layers


@dataclass(frozen=True)
class LocalWindowKV(SlidingWindowKV):
    """Local attention over the last 6 tokens, beside the model's 16-token sliding
    window: its own component, pool, eviction list and L3 objects. Its pool is half the
    size of the other window's (a spec says how it is sized)."""

    window: int = 6
    name: str = "local"

    def pool_size(self, cache, max_running, page_size):
        n, flags, what, unit = super().pool_size(cache, max_running, page_size)
        return max(1, n // 2), flags, "the local-window KV pool", unit


LOCAL = HybridConfig(pattern="FSLM", kinds=(("L", LocalWindowKV()),))


def conversation(eng, rng, turns=2, first=30, new=9, out=4):
    ids, reqs = toks(rng, first), []
    for _ in range(turns):
        r = greedy(ids, out)
        run_checked(eng, [r])
        check_exact(eng, r)
        check_work(r)
        reqs.append(r)
        ids = r.input_ids + r.output_ids + toks(rng, new)
    return reqs, ids


def resumable(r) -> int:
    return len(r.input_ids) + len(r.output_ids) - 1


def test_the_new_spec_becomes_a_component_with_its_own_pool():
    cache, pools = build_cache(LOCAL, page_size=2, max_total_tokens=64)
    assert cache.names == ["full", "swa", "local", "mamba"]
    assert pools["local"].layer_ids == (2,) and pools["local"].size == pools["swa"].size // 2
    local = cache.comps[cache.tree.index["local"]]
    assert local.window == 6 and local.reach == 5


CASES = [("second window", LOCAL),
         ("MLP-only layers", HybridConfig(pattern="F-S-M-")),
         ("KV and a state in one layer", HybridConfig(pattern="HSF")),
         ("all of them", HybridConfig(pattern="H-LSM", kinds=(("L", LocalWindowKV()),))),
         # no full-attention layer: FULL still shapes the tree, over a pool that only
         # counts; nothing above the tree may assume that pool holds data
         ("S only", HybridConfig(pattern="S")), ("M only", HybridConfig(pattern="M")),
         ("S and M", HybridConfig(pattern="SM")), ("M and two S", HybridConfig(pattern="MSS")),
         ("S and F", HybridConfig(pattern="SF"))]


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("what, model", CASES, ids=[c[0] for c in CASES])
def test_device_tier(make_engine, what, model, page):
    eng = make_engine(model, page_size=page, max_total_tokens=1024)
    reqs, _ = conversation(eng, random.Random(1), turns=3)
    for prev, r in zip(reqs, reqs[1:]):
        assert r.metrics.cached_tokens == page_floor(resumable(prev), page)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("what, model", CASES, ids=[c[0] for c in CASES])
def test_host_tier(make_engine, what, model, page):
    """Turn 1, other traffic until the device evicted it to the host, then turn 2 loads
    it back from the host whole."""
    eng = make_engine(model, page_size=page, max_total_tokens=full_budget(model, 128, page), max_mamba_cache_size=8,
                      enable_hierarchical_cache=True, hicache_ratio=8.0)
    rng = random.Random(2)
    (first,), nxt = conversation(eng, rng, turns=1)
    for _ in range(4):
        other = greedy(toks(rng, 40), 3)
        run_checked(eng, [other])
        check_exact(eng, other)
    r = greedy(nxt, 4)
    run_checked(eng, [r])
    check_exact(eng, r)
    want = page_floor(resumable(first), page)
    assert r.metrics.cached_tokens == want and r.metrics.host_tokens == want, r.metrics
    assert eng.cache.stats()["host"]["failed_loads"] == 0


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("what, model", CASES, ids=[c[0] for c in CASES])
def test_storage_tier(make_engine, tmp_path, what, model, page):
    a = make_engine(model, page_size=page, max_total_tokens=1024, storage=FileBackend(str(tmp_path)),
                    prefetch_threshold=1)
    (first,), nxt = conversation(a, random.Random(3), turns=1)
    b = make_engine(model, page_size=page, max_total_tokens=1024, storage=FileBackend(str(tmp_path)),
                    prefetch_threshold=1)
    r = greedy(nxt, 4)
    run_checked(b, [r])
    check_exact(b, r)
    assert r.metrics.storage_tokens == r.metrics.cached_tokens == page_floor(resumable(first), page)
    assert a.stats()["storage_errors"] == 0 and b.stats()["storage_errors"] == 0
    if "L" in model.pattern:  # the new component's objects, under its own name
        assert any(f.endswith(".local") for f in os.listdir(tmp_path))
    a.close()
    b.close()


class TwoShapes:
    """A model whose recurrent layers keep states of different shapes and dtypes (as a
    model mixing two kinds of recurrent mixer does): the pool holds both per slot."""

    def states(self):
        rec = RecurrentState()
        return group_layers([
            LayerState(0, rec, RecurrentShape((8, 3), (2, 4, 4), "float32", "float32")),
            LayerState(1, FullKV(), __import__("uniradix.specs", fromlist=["KVShape"]).KVShape(2, 4)),
            LayerState(2, rec, RecurrentShape((6, 2), (3, 5), "bfloat16", "float32")),
        ], FullKV())


def test_recurrent_states_of_different_shapes_per_layer_share_one_slot():
    cache, pools = build_cache(TwoShapes(), max_total_tokens=32, max_mamba_cache_size=4,
                               enable_hierarchical_cache=True)
    mp = pools["mamba"]
    assert mp.conv(0).shape == (4, 8, 3) and mp.state(0).shape == (4, 2, 4, 4)
    assert mp.conv(2).shape == (4, 6, 2) and mp.conv(2).dtype == torch.bfloat16 and mp.state(2).shape == (4, 3, 5)
    assert mp.nbytes == 4 * (8 * 3 * 4 + 2 * 4 * 4 * 4 + 6 * 2 * 2 + 3 * 5 * 4)
    a, b = mp.alloc(2)
    for layer in (0, 2):
        mp.conv(layer)[a] = torch.randn(mp.conv(layer).shape[1:]).to(mp.conv(layer).dtype)
        mp.state(layer)[a] = torch.randn(mp.state(layer).shape[1:])
    mp.copy_slot(a, b)
    for layer in (0, 2):
        assert torch.equal(mp.conv(layer)[a], mp.conv(layer)[b]) and torch.equal(mp.state(layer)[a],
                                                                                  mp.state(layer)[b])
    # through the host tier and back, layer by layer, byte-exact
    from uniradix.memory import copy_handles
    hp = cache.host_pools[cache.tree.index["mamba"]]
    (h,) = hp.alloc(1)
    copy_handles(mp, [a], hp, [h])
    (c,) = mp.alloc(1)
    for layer in (0, 2):
        copy_handles(hp, [h], mp, [c], layer)
        assert torch.equal(mp.conv(layer)[c], mp.conv(layer)[a]) and torch.equal(mp.state(layer)[c],
                                                                                  mp.state(layer)[a])
    # and as L3 bytes
    from uniradix.hicache.codec import handle_nbytes, read_handles, write_handles
    (blob,) = read_handles(mp, [a])
    assert len(blob) == handle_nbytes(mp) == mp.bytes_per_handle
    write_handles(mp, [b], [blob])
    for layer in (0, 2):
        assert torch.equal(mp.state(layer)[b], mp.state(layer)[a])
