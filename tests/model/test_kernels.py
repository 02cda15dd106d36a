"""The row-invariant kernels (uniradix.model.kernels): each output element is the same
bits whatever rows come with it, however a sequence is cut, and however many threads
share the work; and each is the function it names, within a few roundings of float64.

These kernels are what keeps reuse exact in every precision (the family checks in
tests/model/hf compare the engine with the no-cache forward bit for bit); here each op
is held to the property on its own, on shapes with tails everywhere (columns not a
multiple of the panel, inner sizes not a multiple of the vector)."""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from uniradix.model import kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = pytest.mark.skipif(os.environ.get("UNIRADIX_KERNELS", "").lower() == "torch",
                                reason="UNIRADIX_KERNELS=torch: the kernels are switched off")


def test_the_kernels_build_on_this_machine():
    """CI and every test machine have a C compiler: the kernels must load (their absence
    would silently turn the bit-for-bit checks into torch's row-dependent kernels)."""
    assert kernels.available(), kernels.describe()
    assert "row-invariant kernels" in kernels.describe()


def _cuts(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(n, i + size)) for i in range(0, n, size)]


# ---------------------------------------------------------------------------- products
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 64), (33, 17), (200, 640), (40, 1602), (16, 1), (1, 40)], ids=str)
def test_a_row_is_the_same_bits_alone_or_among_any_rows(dtype, shape):
    torch.manual_seed(0)
    N, K = shape
    w = (torch.randn(N, K) * 0.1).to(dtype)
    b = torch.randn(N).to(dtype)
    x = torch.randn(50, K).to(dtype)
    pw = kernels.PackedWeight(w)
    assert torch.equal(pw.dense(), w) and pw.shape == (N, K) and pw.dtype == dtype
    together = kernels.linear(x, pw, b)
    assert together.dtype == dtype and together.shape == (50, N)
    for size in (1, 2, 3, 5, 6, 7, 8, 9, 13, 49):
        parts = torch.cat([kernels.linear(x[a:z], pw, b) for a, z in _cuts(50, size)])
        assert torch.equal(parts, together), size
    ref = F.linear(x.double(), w.double(), b.double())
    # float32 accumulation, one rounding to the dtype at the end
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype] * max(1.0, ref.abs().max().item())
    assert (together.double() - ref).abs().max().item() <= tol


def test_threads_do_not_change_a_bit():
    torch.manual_seed(1)
    w = torch.randn(300, 96)
    pw = kernels.PackedWeight(w)
    x = torch.randn(40, 96)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(torch.cat([kernels.linear(x[:1], pw), kernels.linear(x[1:], pw)]))
        assert all(torch.equal(o, outs[0]) for o in outs)
    finally:
        torch.set_num_threads(before)


def test_products_take_any_leading_shape_and_refuse_a_wrong_width():
    torch.manual_seed(2)
    pw = kernels.PackedWeight(torch.randn(24, 32))
    x = torch.randn(3, 5, 32)
    assert torch.equal(kernels.linear(x, pw), kernels.linear(x.reshape(15, 32), pw).reshape(3, 5, 24))
    assert kernels.linear(torch.randn(0, 32), pw).shape == (0, 24)
    with pytest.raises(ValueError, match="32"):
        kernels.linear(torch.randn(2, 31), pw)
    stack = kernels.PackedExperts(torch.randn(3, 8, 32))
    assert len(stack) == 3 and stack.shape == (3, 8, 32) and torch.equal(stack[1].dense(), stack.dense()[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_row_alone_equals_the_same_row_among_five(dtype):
    """The regression of issue 29: gemm.dense multiplied one row (a decode step) in the
    16-bit dtype and several in float32 on a CPU without a fast 16-bit GEMM, so keys and
    states written by a decode step differed from the same tokens prefilled."""
    from uniradix.model.hf.gemm import dense, pack
    torch.manual_seed(3)
    w = pack((torch.randn(256, 640) * 0.05).to(dtype))
    x = torch.randn(5, 640).to(dtype)
    five = dense(x, w)
    alone = torch.cat([dense(x[i:i + 1], w) for i in range(5)])
    assert torch.equal(alone, five)
    plain = (torch.randn(48, 64) * 0.1).to(dtype)  # a weight not packed at load goes the same way
    y = torch.randn(7, 64).to(dtype)
    assert torch.equal(torch.cat([dense(y[i:i + 1], plain) for i in range(7)]), dense(y, plain))


# ---------------------------------------------------------------------------- elementwise
REFERENCE = {
    "exp": torch.exp, "sigmoid": torch.sigmoid, "silu": F.silu, "softplus": lambda t: F.softplus(t, threshold=20.0),
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "tanh": torch.tanh,
}


@pytest.mark.parametrize("op", list(kernels.OPS))
def test_an_elementwise_value_does_not_depend_on_the_call(op):
    """torch's float32 sigmoid, silu, softplus and gelu give an element other bits in the
    scalar tail of a call than in its vector body; these do not."""
    torch.manual_seed(4)
    x = torch.randn(3001) * 6
    param = 20.0 if op == "softplus" else 0.0
    whole = kernels.elementwise(op, x, param)
    for size in (1, 3, 7, 8, 15, 17, 1000):
        parts = torch.cat([kernels.elementwise(op, x[a:z], param) for a, z in _cuts(len(x), size)])
        assert torch.equal(parts, whole), size
    ref = REFERENCE[op](x.double())
    # a few float32 roundings of the float64 function (absolute below 1: gelu's 1 + tanh
    # cancels in float32, in torch's too)
    rel = ((whole.double() - ref).abs() / ref.abs().clamp(min=1.0)).max().item()
    assert rel < 2e-6, rel
    long = torch.randn(9001) * 6               # several of the call's blocks of 4096
    for dtype in (torch.bfloat16, torch.float16):  # computed in float32, rounded once
        for t in (x, long):
            assert torch.equal(kernels.elementwise(op, t.to(dtype), param),
                               kernels.elementwise(op, t.to(dtype).float(), param).to(dtype))
        apart = long.to(dtype)[::3]                # rows that lie apart: the same values, the same dtype
        assert torch.equal(kernels.elementwise(op, apart, param), kernels.elementwise(op, apart.contiguous(), param))


@pytest.mark.parametrize("op", list(kernels.OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_gated_product_is_the_bits_of_its_two_ops(op, dtype):
    """act_mul(op, g, u): elementwise(op, g) * u in one call, the same bits, for g and u
    contiguous and as the two halves of one fused product's rows (rows apart), across the
    call's blocks of 4096; other dtypes and layouts are left to the caller (None)."""
    torch.manual_seed(6)
    param = 20.0 if op == "softplus" else 0.0
    for rows, n in ((1, 7), (3, 640), (5, 4100)):
        both = (torch.randn(rows, 2 * n) * 4).to(dtype)
        g, u = both[:, :n], both[:, n:]                       # strided rows: the fused gate-and-up's halves
        for a, b in ((g, u), (g.contiguous(), u.contiguous()), (g.contiguous(), u)):
            got = kernels.act_mul(op, a, b, param)
            assert got is not None and got.dtype == dtype and got.is_contiguous()
            assert torch.equal(got, kernels.elementwise(op, a.contiguous(), param) * b), (rows, n)
    x = torch.randn(4, 8)
    assert kernels.act_mul(op, x.half(), x.half()) is None                 # float16: the two ops
    assert kernels.act_mul(op, x, x.bfloat16()) is None                    # mixed dtypes
    assert kernels.act_mul(op, x.t(), x.t()) is None                       # a row's elements apart


def test_elementwise_edges():
    x = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, 89.0, -87.0, -88.0, -200.0, 200.0, float("inf"),
                      float("-inf"), float("nan"), 20.0, 20.5, 1e-8])
    e = kernels.elementwise("exp", x)
    assert e[0] == 1 and e[9] == math.inf and e[8] == 0 and e[10] == math.inf and e[11] == 0 and e[12].isnan()
    assert torch.isfinite(e[4]) and e[5] == math.inf
    s = kernels.elementwise("sigmoid", x)
    assert s[9] == 1 and s[8] == 0 and s[0] == 0.5
    sp = kernels.elementwise("softplus", x, 20.0)
    assert sp[14] == 20.5 and sp[15] > 0 and abs(sp[15].item() - math.log1p(math.exp(1e-8))) < 1e-7
    t = kernels.elementwise("tanh", x)
    assert t[9] == 1 and t[8] == -1 and t[0] == 0 and t[3] == -1e-30
    assert kernels.elementwise("silu", torch.tensor([-200.0]))[0] == 0


# ---------------------------------------------------------------------------- attention
def _attention_case(dtype, sinks: bool):
    torch.manual_seed(5)
    H, KV, d, slots = 4, 2, 20, 64
    kp, vp = torch.randn(slots, KV, d).to(dtype), torch.randn(slots, KV, d).to(dtype)
    # two requests: keys at scattered slots (pages), queries reading a causal span and a window
    keys = torch.randperm(slots)[:30]
    a_keys, b_keys = keys[:18], keys[18:]
    q = torch.randn(7, H, d)
    # rows 0-4: request a at positions 13..17 reading from 0 (causal); rows 5-6: request b,
    # positions 10, 11 under a window of 4 (its span starts at position 0)
    first = torch.tensor([0, 0, 0, 0, 0, 18 + 7, 18 + 8])
    count = torch.tensor([14, 15, 16, 17, 18, 4, 4])
    s = torch.randn(H) if sinks else None
    return q, kp, vp, torch.cat([a_keys, b_keys]), first, count, s


# queries in float32 over pools of every dtype, and bfloat16 over bfloat16 (a bfloat16
# model's attention: bfloat16 products, the weights rounded, the output in bfloat16)
QK_DTYPES = [(torch.float32, dt) for dt in DTYPES] + [(torch.bfloat16, torch.bfloat16)]
QK_IDS = [f"{str(a)[6:]}-{str(b)[6:]}" for a, b in QK_DTYPES]


def _attention_tolerance(qdt) -> float:
    """float32 queries: float32 arithmetic; bfloat16: weights and output rounded to bfloat16"""
    return 1e-5 if qdt is torch.float32 else 2e-2


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("qdt,dtype", QK_DTYPES, ids=QK_IDS)
def test_attention_is_per_query_and_is_softmax_attention(qdt, dtype, sinks):
    q, kp, vp, keys, first, count, s = _attention_case(dtype, sinks)
    q = q.to(qdt)
    scale = 0.3
    out = kernels.attention(q, kp, vp, keys, first, count, scale, s)
    assert out.dtype is qdt
    wide = kernels.attention(q, kp, vp, keys, first, count, scale, s, dtype=torch.float32)
    assert torch.equal(wide.to(qdt), out)   # the output rounded once
    for r in range(len(q)):  # each query alone: the same bits
        one = kernels.attention(q[r:r + 1], kp, vp, keys, first[r:r + 1], count[r:r + 1], scale, s, dtype=torch.float32)
        assert torch.equal(one, wide[r:r + 1]), r
    for r in range(len(q)):
        sl = keys[first[r]:first[r] + count[r]]
        k = kp[sl].double().repeat_interleave(2, dim=1)          # [n, H, d]
        v = vp[sl].double().repeat_interleave(2, dim=1)
        logits = torch.einsum("hd,nhd->hn", q[r].double(), k) * scale
        if s is not None:
            logits = torch.cat([logits, s.double()[:, None]], dim=1)
            v = torch.cat([v, torch.zeros(1, *v.shape[1:], dtype=v.dtype)])
        ref = torch.einsum("hn,nhd->hd", logits.softmax(-1), v)
        assert (out[r].double() - ref).abs().max().item() < _attention_tolerance(qdt)


@pytest.mark.parametrize("shape", [(8, 2, 24), (6, 2, 32), (3, 3, 16), (4, 2, 20), (4, 1, 256), (2, 1, 70), (72, 1, 16)],
                         ids=str)
@pytest.mark.parametrize("qdt,dtype", QK_DTYPES, ids=QK_IDS)
def test_attention_over_long_spans_is_the_same_bits_in_any_block(qdt, dtype, shape):
    """A prefill chunk of 90 rows over 300 earlier keys (query blocks of 64, key tiles of
    64) and windowed rows: each row's output is the bits of that row alone, of the chunk
    cut anywhere, and within float32 of softmax attention. Heads per KV head 4, 3 and 1,
    so that a block's queries come in every count (float32 scores take them in pairs on
    AVX-512: one left over, or a group of 1-7; bfloat16 ones in groups of 1-4), and head
    sizes past the vector width (bfloat16: 256, and 70, a tail of pairs); 72 heads a KV
    head, more than a block's 64 queries (the heads in parts: it crashed)."""
    torch.manual_seed(5)
    (H, KV, d), n_slots = shape, 500
    kp, vp = torch.randn(n_slots, KV, d).to(dtype), torch.randn(n_slots, KV, d).to(dtype)
    keys = torch.randperm(n_slots)[:390]
    N = 90
    q = torch.randn(N, H, d).to(qdt)
    causal_first = torch.zeros(N, dtype=torch.int64)
    causal_count = torch.arange(301, 301 + N)
    window = 70
    win_first = (causal_count - window).clamp(min=0)
    for first, count in ((causal_first, causal_count), (win_first, causal_count - win_first)):
        out = kernels.attention(q, kp, vp, keys, first, count, 0.2, dtype=torch.float32)   # every bit of the sums
        for cut in (1, 7, 33, 64):
            parts = [kernels.attention(q[i:i + cut], kp, vp, keys, first[i:i + cut], count[i:i + cut], 0.2,
                                       dtype=torch.float32) for i in range(0, N, cut)]
            assert torch.equal(torch.cat(parts), out), cut
        for r in (0, 45, 89):
            sl = keys[first[r]:first[r] + count[r]]
            k = kp[sl].double().repeat_interleave(H // KV, dim=1)
            v = vp[sl].double().repeat_interleave(H // KV, dim=1)
            ref = torch.einsum("hn,nhd->hd", (torch.einsum("hd,nhd->hn", q[r].double(), k) * 0.2).softmax(-1), v)
            assert (out[r].double() - ref).abs().max().item() < _attention_tolerance(qdt)


def test_bfloat16_attention_rounds_its_weights_as_torch_does():
    """bfloat16 queries over bfloat16 pools round the softmax's weights to bfloat16 before
    they meet the values, as torch's bfloat16 SDPA and an eager bfloat16 attention (HF's)
    do: two keys of weights 1 and 0.999 (1 in bfloat16) over values 1 and -1 give 0, where
    float32 weights give 0.001 / 1.999."""
    q = torch.tensor([[[1.0, 0.0]]]).bfloat16()
    kp = torch.tensor([[[0.0, 0.0]], [[-0.001, 0.0]]]).bfloat16()
    vp = torch.tensor([[[1.0, 1.0]], [[-1.0, -1.0]]]).bfloat16()
    args = (torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([2]), 1.0)
    out = kernels.attention(q, kp, vp, *args)
    sdpa = F.scaled_dot_product_attention(q.view(1, 1, 1, 2), kp.view(1, 1, 2, 2), vp.view(1, 1, 2, 2), scale=1.0)
    assert out.dtype is torch.bfloat16 and torch.equal(out.view(-1), sdpa.view(-1)) and out.abs().max() == 0
    wide = kernels.attention(q.float(), kp, vp, *args)   # float32 queries: float32 weights
    assert wide.dtype is torch.float32 and abs(wide[0, 0, 0].item() - 0.0009995 / 1.9990005) < 2e-6


def test_rms_norm_is_per_row_and_is_rms_norm():
    torch.manual_seed(8)
    x = torch.randn(13, 70) * 3
    w = torch.randn(70)
    y = kernels.rms_norm(x, w, 1e-6)
    for r in range(13):
        assert torch.equal(kernels.rms_norm(x[r:r + 1], w, 1e-6), y[r:r + 1])
    ref = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
    assert (y.double() - ref).abs().max().item() < 1e-5
    assert torch.equal(kernels.rms_norm(x.bfloat16(), None, 1e-6), kernels.rms_norm(x.bfloat16().float(), None, 1e-6))
    for dt in DTYPES:  # rounded to the dtype asked for inside the call, as torch's .to() rounds
        assert torch.equal(kernels.rms_norm(x.to(dt), w, 1e-6, dt), kernels.rms_norm(x.to(dt), w, 1e-6).to(dt))
    with pytest.raises(ValueError, match="scale"):
        kernels.rms_norm(x, torch.randn(69), 1e-6)


# ---------------------------------------------------------------------------- recurrences
def _naive_delta(q, k, v, beta, g, S):
    B, T, H, dk = q.shape
    out = torch.empty(B, T, H, v.shape[-1], dtype=torch.float64)
    S = S.double().clone()
    for t in range(T):
        S = S * g[:, t].double().exp()[..., None, None]
        kt = k[:, t].double()
        u = (v[:, t].double() - torch.einsum("bhi,bhij->bhj", kt, S)) * beta[:, t].double()[..., None]
        S = S + kt[..., None] * u[:, :, None, :]
        out[:, t] = torch.einsum("bhi,bhij->bhj", q[:, t].double(), S)
    return out, S


def test_the_delta_rule_reaches_the_same_state_however_a_sequence_is_cut():
    torch.manual_seed(6)
    B, T, H, dk, dv = 2, 37, 3, 12, 10
    q, k = F.normalize(torch.randn(B, T, H, dk), dim=-1), F.normalize(torch.randn(B, T, H, dk), dim=-1)
    v, beta, g = torch.randn(B, T, H, dv), torch.rand(B, T, H), -torch.rand(B, T, H)
    S0 = torch.randn(B, H, dk, dv)
    out, S = kernels.delta_rule(q, k, v, beta, g, S0)
    for size in (1, 5, 16):
        St, outs = S0, []
        for a, z in _cuts(T, size):
            o, St = kernels.delta_rule(q[:, a:z], k[:, a:z], v[:, a:z], beta[:, a:z], g[:, a:z], St)
            outs.append(o)
        assert torch.equal(torch.cat(outs, dim=1), out) and torch.equal(St, S), size
    one, _ = kernels.delta_rule(q[1:], k[1:], v[1:], beta[1:], g[1:], S0[1:])  # a request alone
    assert torch.equal(one, out[1:])
    ref_out, ref_S = _naive_delta(q, k, v, beta, g, S0)
    assert (out.double() - ref_out).abs().max().item() < 1e-4 and (S.double() - ref_S).abs().max().item() < 1e-4


def test_the_selective_scan_reaches_the_same_state_however_a_sequence_is_cut():
    torch.manual_seed(7)
    B, T, H, P, N = 2, 29, 3, 6, 11
    x, dt = torch.randn(B, T, H, P), torch.rand(B, T, H) * 0.5
    A = -torch.rand(H) * 2
    Bm, C = torch.randn(B, T, H, N), torch.randn(B, T, H, N)
    S0 = torch.randn(B, H, P, N)
    y, S = kernels.ssm_scan(x, dt, A, Bm, C, S0)
    for size in (1, 4, 13):
        St, ys = S0, []
        for a, z in _cuts(T, size):
            o, St = kernels.ssm_scan(x[:, a:z], dt[:, a:z], A, Bm[:, a:z], C[:, a:z], St)
            ys.append(o)
        assert torch.equal(torch.cat(ys, dim=1), y) and torch.equal(St, S), size
    ref = S0.double().clone()
    for t in range(T):
        a = (dt[:, t].double() * A.double()).exp()[..., None, None]
        ref = ref * a + (x[:, t].double() * dt[:, t].double()[..., None])[..., None] * Bm[:, t].double()[:, :, None, :]
        assert (y[:, t].double() - torch.einsum("bhpn,bhn->bhp", ref, C[:, t].double())).abs().max() < 1e-4
    assert (S.double() - ref).abs().max().item() < 1e-4


# ---------------------------------------------------------------------------- RoPE
def test_rope_values_do_not_depend_on_the_positions_asked_with_them():
    from uniradix.model.hf.ops import rope_cos_sin, rope_inv_freq
    ROPE_BLOCK = kernels.BlockTable.BLOCK
    inv, scaling = rope_inv_freq({"rope_theta": 10000.0, "rope_type": "default"}, 6)
    pos = torch.arange(0, 3 * ROPE_BLOCK + 5)
    cos, sin = rope_cos_sin(pos, inv, scaling, torch.float32)
    for chosen in (torch.tensor([5]), torch.tensor([3 * ROPE_BLOCK + 4, 2]), torch.arange(17, 40)):
        c, s = rope_cos_sin(chosen, inv, scaling, torch.float32)
        assert torch.equal(c, cos[chosen]) and torch.equal(s, sin[chosen])
    fresh = inv.clone()  # a table of its own, grown from a small position first
    c5, _ = rope_cos_sin(torch.tensor([5]), fresh, scaling, torch.float32)
    c_all, s_all = rope_cos_sin(pos, fresh, scaling, torch.float32)
    assert torch.equal(c5, cos[5:6]) and torch.equal(c_all, cos) and torch.equal(s_all, sin)
    freqs = pos[:, None].double() * inv.double()[None]
    assert (cos[:, :3].double() - freqs.cos()).abs().max() < 1e-3  # float32 products of large positions


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_product_converts_its_input_and_rounds_its_output_as_torch_would(dtype):
    """16-bit activations are read and a bfloat16 output rounded inside the one call
    (ur_linear_io), and rows that lie apart (a fused product's part) are read where they
    are: the bits of the float32 product over x.float(), rounded by torch's .to(). (Of
    the vector path's chain: a bfloat16 x bfloat16 product on AMX's tiles is another
    arithmetic, so there AMX is off; test_bfloat16_products_on_amx_tiles checks its
    rounding.)"""
    torch.manual_seed(12)
    K, N = 96, 40
    w = kernels.PackedWeight((torch.randn(N, K) * 0.1).to(dtype))
    wide = torch.randn(7, 3 * K).to(dtype)
    x = wide[:, K:2 * K]                                   # rows 3K apart
    x[0, :4] = torch.tensor([3e38, -3e38, 1e-40, float("nan")]).to(dtype)   # overflow, subnormal, NaN
    with kernels.no_amx():
        y = kernels.linear(x, w)
    ref = kernels.linear(x.float().contiguous(), w).to(dtype)
    assert y.dtype == dtype and y.shape == (7, N)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y[~y.isnan()], ref[~ref.isnan()])
    assert torch.isinf(y[0]).any() or torch.isnan(y[0]).any()


def _pair_chain(x: torch.Tensor, w: torch.Tensor, odd_first: bool) -> torch.Tensor:
    """The documented chain of a paired bfloat16 product, in float64 where each step is
    exact (bfloat16 x bfloat16 products, sums of like magnitude), rounded to float32
    after every fused multiply-add: per pair of inputs the odd one first (VDPBF16PS),
    or the even one first (the order before it)."""
    x, w = x.double(), w.double()
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for k in range(0, x.shape[1], 2):
        for i in ((k + 1, k) if odd_first else (k, k + 1)):
            acc = (acc + x[:, i:i + 1] * w[:, i][None]).float().double()
    return acc.float()


def test_paired_bfloat16_products_are_vdpbf16ps_chain():
    """A bfloat16 x bfloat16 product over paired panels is VDPBF16PS's arithmetic on every
    CPU: per pair of inputs the odd product first, then the even one, each fused and
    rounded to float32; denormal inputs read as zero and denormal sums flushed to zero.
    Where the CPU has AVX512-BF16 the instruction computes it; elsewhere the vector
    chain does the same steps (test_instruction_sets compares the builds bit for bit).
    float32 rows against the same panels take the same chain."""
    torch.manual_seed(31)
    M, N, K = 6, 21, 38                                      # K % 32 != 0: never AMX's tiles
    x, wd = torch.randn(M, K).bfloat16(), (torch.randn(N, K) * 0.1).bfloat16()
    w = kernels.PackedWeight(wd)
    assert w.paired
    with kernels.no_amx():
        y = kernels.linear(x, w, dtype=torch.float32)
        assert torch.equal(kernels.linear(x.float(), w), y)
        odd_first = _pair_chain(x, wd, True)
        assert torch.equal(y, odd_first)
        assert not torch.equal(y, _pair_chain(x, wd, False))   # the order shows in the bits
        one = torch.ones(1, 2).bfloat16()
        tiny = kernels.linear(torch.tensor([[2.0 ** -70, 0.0]]).bfloat16(),
                              kernels.PackedWeight(torch.full((16, 2), 2.0 ** -70).bfloat16()), dtype=torch.float32)
        assert torch.equal(tiny, torch.zeros(1, 16))        # a denormal sum (2^-140) flushed to zero
        sub = torch.tensor([[1e-40, 1.0]]).bfloat16()        # a denormal input read as zero
        assert sub[0, 0] != 0
        big = kernels.PackedWeight(torch.tensor([[2.0 ** 100, 0.0]] * 16).bfloat16())
        assert torch.equal(kernels.linear(sub, big, dtype=torch.float32), torch.zeros(1, 16))   # not 1e-40 * 2^100
        assert torch.equal(kernels.linear(one, kernels.PackedWeight(torch.ones(16, 2).bfloat16())), torch.full((1, 16), 2.0).bfloat16())


@pytest.mark.skipif(not kernels.amx_bfloat16(), reason="no AMX bfloat16 tiles on this CPU")
@pytest.mark.parametrize("K", [32, 96, 640, 2048])
def test_bfloat16_products_on_amx_tiles(K):
    """Where the CPU has AMX, a bfloat16 x bfloat16 product takes its tiles at every row
    count (the row count never picks the arithmetic): a row is the same bits alone,
    among any rows (a decode step, a verify step of 17, a prefill chunk) and on any
    thread count; each output is the float32 sum of exact products, within a few
    roundings of the vector path's chain and of float64, rounded once to bfloat16 as
    torch rounds (overflow to infinity, a NaN kept). The kernels' identity names the
    tiles for bfloat16 and only for it (the L3 witness keeps KV from another CPU apart)."""
    torch.manual_seed(K)
    N = 45                                                       # a last panel of 13 outputs
    w = kernels.PackedWeight((torch.randn(N, K) * 0.05).bfloat16())
    b = torch.randn(N)
    x = torch.randn(50, K).bfloat16()
    sums = kernels.linear(x, w, b, dtype=torch.float32)          # the float32 sums, before the rounding
    for size in (1, 3, 16, 17, 31, 33, 49):
        parts = [kernels.linear(x[a:z], w, b, dtype=torch.float32) for a, z in _cuts(50, size)]
        assert torch.equal(torch.cat(parts), sums), size
    before = torch.get_num_threads()
    try:
        for n in (2, 3):
            torch.set_num_threads(n)
            assert torch.equal(kernels.linear(x, w, b, dtype=torch.float32), sums)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(kernels.linear(x, w, b), sums.bfloat16())  # rounded once, as torch rounds
    assert torch.equal(kernels.linear(x, w, dtype=torch.float32) + b, sums)   # the bias added to the sum
    with kernels.no_amx():
        chain = kernels.linear(x, w, b, dtype=torch.float32)
    assert not torch.equal(sums, chain)                          # another arithmetic...
    ref = F.linear(x.double(), w.dense().double(), b.double())
    scale = ref.abs().max().item()
    for y in (sums, chain):                                      # ...the same sum within float32's roundings
        assert (y.double() - ref).abs().max().item() <= 1e-5 * scale * K ** 0.5
    edge = torch.ones(3, K).bfloat16()
    edge[0], edge[1, 0], edge[2] = 3e38, float("nan"), -3e38
    y = kernels.linear(edge, kernels.PackedWeight(torch.ones(N, K).bfloat16()))
    assert y[1].isnan().all() and (y[0] == float("inf")).all() and (y[2] == float("-inf")).all()
    assert kernels.identity(torch.bfloat16) != kernels.identity(torch.float32)
    with kernels.no_amx():
        assert kernels.identity(torch.bfloat16) == kernels.identity(torch.float32)


def test_argmax_answers_as_torch_argmax():
    """Greedy sampling's argmax: the first of equal maxima, the first NaN where there is
    one, -0.0 and 0.0 equal; and a view's row (a batch's logits split by request)."""
    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(262_144, generator=g), torch.tensor([1.0, 3.0, 3.0, 2.0]), torch.tensor([nan, 1.0]),
            torch.tensor([1.0, nan, 5.0, nan]), torch.tensor([-0.0, 0.0]), torch.tensor([0.0, -0.0]),
            torch.tensor([-inf] * 3), torch.tensor([-1e30, inf, inf]), torch.tensor([2.0]),
            torch.randint(-3, 3, (1000,), generator=g).float()]
    batch = torch.randn(3, 777, generator=g)
    rows += list(batch.split(1))[0:1] + [batch[2], batch[:, 5]]
    for x in rows:
        x = x.reshape(-1) if x.dim() > 1 else x
        assert kernels.argmax(x) == int(torch.argmax(x)), x
    with pytest.raises(ValueError):
        kernels.argmax(torch.zeros(2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rot", [64, 32], ids=["full", "partial"])
def test_rope_is_torch_ops_bit_for_bit(dtype, rot):
    """kernels.rope: x * cos + roll(x, rot / 2) * signed_sin on the first rot dims (the
    rest passed through), each op rounded as torch rounds it, the same bits."""
    g = torch.Generator().manual_seed(4)
    N, H, d = 5, 3, 64
    x = (torch.randn(N, H, d, generator=g) * 4).to(dtype)
    ang = torch.randn(N, rot // 2, generator=g) * 3
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dtype)
    sin = torch.cat((-ang.sin(), ang.sin()), -1).to(dtype)
    c, s = cos[:, None], sin[:, None]
    xr = x[..., :rot]
    want = torch.cat((xr * c + xr.roll(rot // 2, -1) * s, x[..., rot:]), -1)
    got = kernels.rope(x, c, s)
    assert got.dtype == dtype and torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                              want.view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert torch.equal(kernels.rope(x[2:3], c[2:3], s[2:3]), got[2:3])  # a row alone: the same
    with pytest.raises(ValueError):
        kernels.rope(x, c.float() if dtype != torch.float32 else c.double(), s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_with_a_residual_is_the_add_after_it(dtype):
    """residual + rms_norm(x) in one call: the norm rounded to the residual's dtype, then
    torch's add, bit for bit."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 300, generator=g).to(dtype)
    res = (torch.randn(7, 300, generator=g) * 10).to(dtype)
    w = torch.randn(300, generator=g)
    want = res + kernels.rms_norm(x, w, 1e-6, dtype)
    got = kernels.rms_norm(x, w, 1e-6, dtype, residual=res)
    assert torch.equal(got, want)
    with pytest.raises(ValueError):
        kernels.rms_norm(x, w, 1e-6, dtype, residual=res.double())
