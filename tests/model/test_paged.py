"""The paged forward against the oracle: chunked prefill through the pools, and a
second request resuming from a captured checkpoint with the pages it reuses."""
from array import array

import pytest
import torch

from uniradix.model import init_weights, preset, reference_forward
from uniradix.model.paged import PagedInput, paged_forward
from uniradix.memory import KVPool, MambaStatePool


def make_pools(cfg, page, pages=64, slots=8):
    H, hd = cfg.n_heads, cfg.head_dim
    pools = {
        "full": KVPool(cfg.layers("F") or [0], pages, page, cfg.n_kv_heads, hd, torch.float32, name="full"),
        "swa": KVPool(cfg.layers("S") or [0], pages, page, cfg.n_kv_heads, hd, torch.float32, name="swa"),
        "mamba": MambaStatePool(cfg.layers("M") or [0], slots, (H * hd, cfg.conv_kernel - 1),
                                (H, cfg.state_dim, hd), torch.float32),
    }
    return pools


def tokens(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ["tiny-hybrid", "qwen3-next-like", "gpt-oss-like", "gemma3-like", "jamba-like"])
@pytest.mark.parametrize("page", [1, 4])
def test_chunked_prefill_matches_the_oracle(name, page):
    cfg = preset(name)
    w = init_weights(cfg)
    pools = make_pools(cfg, page)
    ids = tokens(37)
    ref = reference_forward(cfg, w, ids)
    n_pages = -(-len(ids) // page)
    full = pools["full"].alloc(n_pages)
    swa = pools["swa"].alloc(n_pages)
    slot = pools["mamba"].alloc(1)[0]
    pools["mamba"].zero_slots([slot])
    start = 0
    for end in (5, 6, 20, 37):
        out = paged_forward(cfg, w, pools, [PagedInput(ids[start:end], start, full, swa, slot)])[0]
        assert (out - ref[start:end]).abs().max() < 1e-4
        start = end


@pytest.mark.parametrize("name", ["tiny-hybrid", "jamba-like"])
def test_resume_from_a_captured_checkpoint_with_reused_pages(name):
    page = 4
    cfg = preset(name)
    w = init_weights(cfg)
    pools = make_pools(cfg, page)
    first = tokens(24)
    b = 16  # the boundary the second request resumes at
    full = pools["full"].alloc(6)
    swa = pools["swa"].alloc(6)
    slot, ckpt = pools["mamba"].alloc(2)
    pools["mamba"].zero_slots([slot, ckpt])
    paged_forward(cfg, w, pools, [PagedInput(first, 0, full, swa, slot, capture={b: ckpt})])
    second = first[:b] + tokens(10, seed=9)
    # it reuses FULL pages of [0, b), the SWA window before b, and a copy of the checkpoint
    mine = pools["mamba"].alloc(1)[0]
    pools["mamba"].copy_slot(ckpt, mine)
    own_full = pools["full"].alloc(3)
    own_swa = pools["swa"].alloc(3)
    lo_page = max(0, b - cfg.window + 1) // page
    swa_pages = array("i", [-1] * lo_page) + swa[lo_page:b // page] + own_swa
    out = paged_forward(cfg, w, pools, [PagedInput(second[b:], b, full[:b // page] + own_full,
                                                   swa_pages, mine)])[0]
    ref = reference_forward(cfg, w, second)
    assert (out - ref[b:]).abs().max() < 1e-4


def test_an_absent_window_page_is_an_error():
    cfg = preset("gemma3-like")
    w = init_weights(cfg)
    pools = make_pools(cfg, 4)
    full = pools["full"].alloc(4)
    with pytest.raises(ValueError, match="absent"):
        paged_forward(cfg, w, pools, [PagedInput(tokens(4), 12, full, array("i", [-1] * 4), None)])
