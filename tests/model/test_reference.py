"""The oracle model: deterministic, causal, windowed where it should be, and its
recurrent state resumable from any position (what a checkpoint relies on)."""
import pytest
import torch

from uniradix.model import PRESETS, ByteTokenizer, HybridConfig, init_weights, preset, reference_forward
from uniradix.model.layers import attend, recurrent_mix, rope


def tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_run_and_are_deterministic(name):
    cfg = preset(name)
    ids = tokens(24)
    a = reference_forward(cfg, init_weights(cfg), ids)
    b = reference_forward(cfg, init_weights(cfg), ids)
    assert a.shape == (24, cfg.vocab_size) and torch.isfinite(a).all()
    assert torch.equal(a, b)
    c = reference_forward(cfg, init_weights(cfg.with_(seed=1)), ids)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize("name", ["tiny-hybrid", "jamba-like", "gemma3-like"])
def test_causal(name):
    cfg = preset(name)
    w = init_weights(cfg)
    ids = tokens(20)
    other = ids[:12] + tokens(8, seed=5)
    a, b = reference_forward(cfg, w, ids), reference_forward(cfg, w, other)
    assert torch.equal(a[:12], b[:12])
    assert not torch.allclose(a[12:], b[12:])


def test_one_sliding_layer_sees_only_its_window():
    cfg = HybridConfig(pattern="S", window=6)
    w = init_weights(cfg)
    ids = tokens(20)
    t = 15
    outside = list(ids)
    outside[t - cfg.window] = (ids[t - cfg.window] + 1) % 256  # just out of the window of t
    inside = list(ids)
    inside[t - cfg.window + 1] = (ids[t - cfg.window + 1] + 1) % 256
    base = reference_forward(cfg, w, ids)[t]
    assert torch.equal(reference_forward(cfg, w, outside)[t], base)
    assert not torch.allclose(reference_forward(cfg, w, inside)[t], base)


def test_recurrent_state_resumes_exactly_from_any_split():
    cfg = preset("jamba-like")
    lw = init_weights(cfg)["layers"][0]
    H, hd, sd = cfg.n_heads, cfg.head_dim, cfg.state_dim
    x = torch.randn(17, cfg.d_model, generator=torch.Generator().manual_seed(3))
    conv0 = torch.zeros(H * hd, cfg.conv_kernel - 1)
    ssm0 = torch.zeros(H, sd, hd)
    whole, conv_w, ssm_w = recurrent_mix(x, lw, conv0, ssm0, H, hd, sd)
    for cut in (1, 2, 5, 16):
        a, conv_a, ssm_a = recurrent_mix(x[:cut], lw, conv0, ssm0, H, hd, sd)
        b, conv_b, ssm_b = recurrent_mix(x[cut:], lw, conv_a, ssm_a, H, hd, sd)
        assert torch.allclose(torch.cat((a, b)), whole, atol=1e-6)
        assert torch.allclose(conv_b, conv_w, atol=1e-6) and torch.allclose(ssm_b, ssm_w, atol=1e-6)


def test_attention_of_new_queries_over_cached_keys_matches_the_whole():
    g = torch.Generator().manual_seed(7)
    T, H, KV, d = 12, 4, 2, 8
    pos = torch.arange(T)
    q = rope(torch.randn(T, H, d, generator=g), pos, 1e4)
    k = rope(torch.randn(T, KV, d, generator=g), pos, 1e4)
    v = torch.randn(T, KV, d, generator=g)
    for window in (None, 3):
        whole = attend(q, k, v, pos, pos, window)
        tail = attend(q[8:], k, v, pos[8:], pos, window)  # queries 8.. over all keys
        assert torch.allclose(tail, whole[8:], atol=1e-6)
        if window:  # and over the window's keys alone
            lo = 8 - window + 1
            part = attend(q[8:], k[lo:], v[lo:], pos[8:], pos[lo:], window)
            assert torch.allclose(part, whole[8:], atol=1e-6)


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="pattern"):
        HybridConfig(pattern="FXM")
    with pytest.raises(ValueError, match="multiple"):
        HybridConfig(n_heads=3, n_kv_heads=2)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")
    assert HybridConfig(pattern="FSM").layers("M") == [2]


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    text = "héllo, hybrid ✓"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < tok.vocab_size
