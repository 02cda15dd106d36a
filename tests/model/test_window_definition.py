"""One definition of the sliding window (design.md §3 SWA): the model's mask, where the
paged forward starts reading SWA KV, and the pages the tree hands out on resuming are
all `first_visible`. A query at i reads keys i - W < j <= i, W keys including itself."""
from array import array

import pytest
import torch

from uniradix.memory import KVPool
from uniradix.model import HybridConfig, init_weights, reference_forward
from uniradix.model.layers import attend
from uniradix.model.paged import PagedInput, paged_forward
from uniradix.tree import SWAComponent
from uniradix.tree.component import first_visible


@pytest.mark.parametrize("W", [1, 2, 3, 5, 8])
def test_the_mask_admits_exactly_the_last_w_keys(W):
    """With zero queries every admitted key gets the same weight, so the output over
    one-hot values shows the admitted set: keys i - W < j <= i, from first_visible(i, W)
    (keys as wide as the values: the row-invariant kernel's attention, where it runs)."""
    S = 12
    pos = torch.arange(S)
    q = torch.zeros(S, 1, S)
    v = torch.eye(S).view(S, 1, S)
    out = attend(q, torch.zeros(S, 1, S), v, pos, pos, W)[:, 0]
    for i in range(S):
        seen = {j for j in range(S) if out[i, j] > 0}
        assert seen == {j for j in range(S) if i - W < j <= i}, (i, W, seen)
        assert min(seen) == max(0, first_visible(i, W))


def _pools(cfg, P, pages=32):
    return {name: KVPool(cfg.layers(kind), pages, P, cfg.n_kv_heads, cfg.head_dim, torch.float32, name=name)
            for name, kind in (("full", "F"), ("swa", "S"))}


@pytest.mark.parametrize("P,W", [(1, 1), (1, 4), (2, 3), (3, 4), (4, 4), (4, 5), (4, 7), (16, 17)])
def test_the_model_reads_exactly_the_swa_pages_the_tree_hands_out(P, W):
    """A second request resumes at b over the first one's pages. With every SWA page
    before the tree's window start absent its logits equal the oracle's (the tree hands
    out all the model reads); with the first page the tree hands out absent too the
    forward refuses (the tree hands out nothing the model does not read)."""
    cfg = HybridConfig(pattern="SF", window=W)
    w = init_weights(cfg)
    swa_rule = SWAComponent(W)
    swa_rule.bind(1, P)
    ids = torch.randint(0, 256, (6 * P + 3,), generator=torch.Generator().manual_seed(W)).tolist()
    ref = reference_forward(cfg, w, ids)
    npg = -(-len(ids) // P)
    for b in range(P, 6 * P + 1, P):
        pools = _pools(cfg, P)
        full, swa = pools["full"].alloc(npg), pools["swa"].alloc(npg)
        paged_forward(cfg, w, pools, [PagedInput(ids[:b], 0, {"full": full, "swa": swa})])
        lo = swa_rule.window_start(b) // P
        handed = array("i", [-1] * lo) + swa[lo:]
        out = paged_forward(cfg, w, pools, [PagedInput(ids[b:], b, {"full": full, "swa": handed})])[0]
        assert (out - ref[b:]).abs().max() < 1e-4, (P, W, b)
        if lo < b // P:
            handed[lo] = -1
            with pytest.raises(ValueError, match="absent"):
                paged_forward(cfg, w, pools, [PagedInput(ids[b:], b, {"full": full, "swa": handed})])
        else:  # W = 1: nothing before b is read
            assert W == 1 and lo == b // P
