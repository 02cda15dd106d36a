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
        out = paged_forward(cfg, w, pools, [PagedInput(ids[start:end], start, {"full": full, "swa": swa}, slot)])[0]
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
    paged_forward(cfg, w, pools, [PagedInput(first, 0, {"full": full, "swa": swa}, slot, capture={b: ckpt})])
    second = first[:b] + tokens(10, seed=9)
    # it reuses FULL pages of [0, b), the SWA window before b, and a copy of the checkpoint
    mine = pools["mamba"].alloc(1)[0]
    pools["mamba"].copy_slot(ckpt, mine)
    own_full = pools["full"].alloc(3)
    own_swa = pools["swa"].alloc(3)
    lo_page = max(0, b - cfg.window + 1) // page
    swa_pages = array("i", [-1] * lo_page) + swa[lo_page:b // page] + own_swa
    out = paged_forward(cfg, w, pools, [PagedInput(second[b:], b, {"full": full[:b // page] + own_full, "swa": swa_pages}, mine)])[0]
    ref = reference_forward(cfg, w, second)
    assert (out - ref[b:]).abs().max() < 1e-4


def test_an_absent_window_page_is_an_error():
    cfg = preset("gemma3-like")
    w = init_weights(cfg)
    pools = make_pools(cfg, 4)
    full = pools["full"].alloc(4)
    with pytest.raises(ValueError, match="absent"):
        paged_forward(cfg, w, pools, [PagedInput(tokens(4), 12, {"full": full, "swa": array("i", [-1] * 4)}, None)])


_WEIGHTS = {}


def init_w(cfg):
    """init_weights, once per config for the batch tests (each primes two sets of pools)."""
    if cfg not in _WEIGHTS:
        _WEIGHTS[cfg] = init_weights(cfg)
    return _WEIGHTS[cfg]


def _batch_scenario(cfg, page):
    """Fresh pools primed with the earlier steps of requests a (24 tokens, checkpoint
    at 16) and d (11 tokens), and a batch of four: r, a fresh prefill capturing a
    checkpoint at 4; a continuing from 24; c, new, resuming from a's checkpoint at 16
    over a's pages of [0, 16); d decoding one token at 11. Returns (pools, batch, full
    sequences, the slots whose state the batch writes)."""
    pools = make_pools(cfg, page, pages=128, slots=8)
    fp, sp, mp = pools["full"], pools["swa"], pools["mamba"]

    def npg(n):  # pages for n positions
        return -(-n // page)

    a_ids = tokens(29, seed=1)  # 24 cached, 5 new in the batch
    a_full, a_swa = fp.alloc(npg(29)), sp.alloc(npg(29))
    a_slot, a_ckpt = mp.alloc(2)
    mp.zero_slots([a_slot, a_ckpt])
    b = 16
    paged_forward(cfg, init_w(cfg), pools, [PagedInput(a_ids[:24], 0, {"full": a_full, "swa": a_swa}, a_slot, capture={b: a_ckpt})])

    d_ids = tokens(12, seed=2)  # 11 cached, 1 new
    d_full, d_swa = fp.alloc(npg(12)), sp.alloc(npg(12))
    d_slot = mp.alloc(1)[0]
    mp.zero_slots([d_slot])
    paged_forward(cfg, init_w(cfg), pools, [PagedInput(d_ids[:11], 0, {"full": d_full, "swa": d_swa}, d_slot)])

    r_ids = tokens(7, seed=3)  # fresh
    r_full, r_swa = fp.alloc(npg(7)), sp.alloc(npg(7))
    r_slot, r_ckpt = mp.alloc(2)
    mp.zero_slots([r_slot, r_ckpt])

    c_ids = a_ids[:b] + tokens(10, seed=4)  # resumes from a's checkpoint, reusing a's pages of [0, b)
    c_slot = mp.alloc(1)[0]
    mp.copy_slot(a_ckpt, c_slot)
    lo_page = max(0, b - cfg.window + 1) // page
    c_full = a_full[:b // page] + fp.alloc(npg(26) - b // page)
    c_swa = array("i", [-1] * lo_page) + a_swa[lo_page:b // page] + sp.alloc(npg(26) - b // page)

    batch = [PagedInput(r_ids, 0, {"full": r_full, "swa": r_swa}, r_slot, capture={4: r_ckpt}),
             PagedInput(a_ids[24:], 24, {"full": a_full, "swa": a_swa}, a_slot),
             PagedInput(c_ids[b:], b, {"full": c_full, "swa": c_swa}, c_slot),
             PagedInput(d_ids[11:], 11, {"full": d_full, "swa": d_swa}, d_slot)]
    return pools, batch, [r_ids, a_ids, c_ids, d_ids], [r_slot, r_ckpt, a_slot, c_slot, d_slot]


@pytest.mark.parametrize("name", ["tiny-hybrid", "gemma3-like"])
@pytest.mark.parametrize("page", [1, 4])
def test_a_batch_matches_the_oracle_and_one_by_one(name, page):
    cfg = preset(name)
    w = init_w(cfg)
    pools, batch, seqs, slots = _batch_scenario(cfg, page)
    outs = paged_forward(cfg, w, pools, batch)
    assert [o.shape[0] for o in outs] == [len(i.tokens) for i in batch]
    for inp, seq, out in zip(batch, seqs, outs):
        ref = reference_forward(cfg, w, seq)
        assert (out - ref[inp.start:inp.end]).abs().max() < 1e-4, inp.start
    # the same steps, one request at a time, on identically primed pools
    pools1, batch1, _, _ = _batch_scenario(cfg, page)
    for inp, out in zip(batch1, outs):
        (one,) = paged_forward(cfg, w, pools1, [inp])
        assert torch.allclose(one, out, atol=1e-5, rtol=0)
    # and they leave the same K/V behind and the same recurrent states (checkpoint included)
    for kind in ("full", "swa"):
        for layer in cfg.layers(kind[0].upper()):
            assert torch.allclose(pools[kind].k(layer), pools1[kind].k(layer), atol=1e-5, rtol=0)
            assert torch.allclose(pools[kind].v(layer), pools1[kind].v(layer), atol=1e-5, rtol=0)
    for layer in cfg.layers("M"):
        for s in slots:
            assert torch.allclose(pools["mamba"].state(layer)[s], pools1["mamba"].state(layer)[s], atol=1e-5)
            assert torch.allclose(pools["mamba"].conv(layer)[s], pools1["mamba"].conv(layer)[s], atol=1e-5)
