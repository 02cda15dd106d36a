"""The row-invariant kernels' AVX-512, AVX2 and scalar paths are one function: built for
this CPU and for a CPU level below it (kernels.isa), every kernel gives the same bits.
So a figure, a stored page or a test's expectation made on one CPU holds on another of
the same arithmetic, and a faster path for one instruction set (AVX-512's quantized
products over AMX's tiles or VNNI's dot products) cannot drift from the others. (Here, beside the
GGUF block tests, for their random blocks of every format.)"""
from __future__ import annotations

import os
import platform
import subprocess

import pytest
import torch

from test_gguf_blocks import FORMATS, random_blocks
from uniradix.model import kernels
from uniradix.model.hf.gguf_blocks import decode

pytestmark = pytest.mark.skipif(os.environ.get("UNIRADIX_KERNELS", "").lower() == "torch" or not kernels.available(),
                                reason="the row-invariant kernels are not built here")


#: what a build for each level below says it runs
LEVELS = {"icelake-server": "avx512, vnni", "x86-64-v4": "avx512", "x86-64-v3": "avx2", "x86-64": "scalar"}
#: bfloat16 pairs with denormals: inputs read as zero, products and sums flushed (VDPBF16PS's rule, emulated below it)
TINY = (2.0 ** -60, 1e-39)


def levels_below() -> list[str]:
    """The x86 CPU levels below this CPU's that the kernels' paths differ by:
    icelake-server (AVX512-VNNI without AVX512-BF16's dot products or AMX's tiles) where
    this CPU has either, x86-64-v4
    (AVX-512 without VNNI) where it has VNNI, x86-64-v3 (the AVX2 paths) where it has
    AVX-512, x86-64 (the scalar ones) on any x86."""
    if platform.machine() not in ("x86_64", "AMD64") or not kernels.available():
        return []
    here = kernels.lib().ur_isa().decode()
    return ((["icelake-server"] if kernels.lib().ur_amx(-1) or "bf16" in here else [])
            + (["x86-64-v4"] if "vnni" in here else [])
            + (["x86-64-v3"] if here.startswith("avx512") else []) + (["x86-64"] if here != "scalar" else []))


def every_kernel() -> list[torch.Tensor]:
    """Every kernel on inputs with tails everywhere: products (dense in three dtypes, bfloat16 activations too,
    denormals in bfloat16 pairs, and
    every GGUF block format, 45 outputs: a padded last panel) at 1 to 9 rows (each row
    tiling of every path) and the quantized ones at 35 (AMX's tiles, two full and a tail), attention over a pool (bfloat16, grouped heads, sinks,
    windows; bfloat16 queries too, with denormals; wide float32 and float16 heads), RMSNorm (with a residual too), RoPE, argmax, the
    greedy head's int8 copy and candidates
    and the elementwise functions."""
    torch.manual_seed(11)
    N, K = 45, 512
    cases = [(kernels.PackedWeight((torch.randn(N, K) * 0.1).to(dt)), kernels.linear)
             for dt in (torch.float32, torch.bfloat16, torch.float16)]
    cases += [(kernels.PackedQuant(decode(f, random_blocks(f, N, K, seed=2), N, K), f), kernels.linear_q)
              for f in FORMATS]
    xs = [torch.randn(m, K) for m in (1, 2, 3, 4, 5, 6, 8, 9)]
    bias = torch.randn(N)
    out = [fn(x, w, bias) for w, fn in cases for x in xs]
    with kernels.no_amx():   # bfloat16 x bfloat16: the vector path's chain (AMX's tiles are their own arithmetic)
        out += [kernels.linear(x.bfloat16(), w, bias) for w, _ in cases[1:2] for x in xs + [torch.randn(35, K)]]
        odd = kernels.PackedWeight((torch.randn(N, K - 1) * 0.1).bfloat16())   # unpaired panels
        out += [kernels.linear(torch.randn(m, K - 1).bfloat16(), odd, bias) for m in (1, 9)]
        small = kernels.PackedWeight((torch.randn(N, K) * TINY[0]).bfloat16())
        for m in (1, 9):   # denormal products, sums and inputs in bfloat16 pairs, float32 rows beside them
            xt = torch.randn(m, K) * TINY[0]
            xt[:, ::3] = TINY[1]
            out += [kernels.linear(xt.bfloat16(), small, dtype=torch.float32), kernels.linear(xt, small)]
    many = torch.randn(35, K)   # quantized products of 16 rows and more: AMX's tiles where this CPU has them
    out += [fn(many, w, bias) for w, fn in cases if fn is kernels.linear_q]
    H, KV, d, slots, rows = 8, 2, 40, 300, 70
    kp, vp = torch.randn(slots, KV, d).to(torch.bfloat16), torch.randn(slots, KV, d).to(torch.bfloat16)
    keys = torch.randperm(slots)[:200]
    count = torch.arange(131, 131 + rows)
    first = torch.zeros(rows, dtype=torch.int64)
    first[::3] = (count[::3] - 50).clamp(min=0)                   # every third row: a window of 50
    count = count - first
    out.append(kernels.attention(torch.randn(rows, H, d), kp, vp, keys, first, count, 0.3, torch.randn(H)))
    # bfloat16 queries over the same pools: VDPBF16PS's arithmetic (a tail of pairs at d 40),
    # then a head of 256 in groups of 1-4 queries, denormal queries, keys and values among them
    out.append(kernels.attention(torch.randn(rows, H, d).bfloat16(), kp, vp, keys, first, count, 0.3, torch.randn(H),
                                 dtype=torch.float32))
    for G, n in ((4, 70), (3, 9), (1, 5), (2, 1)):
        kt, vt = torch.randn(slots, 1, 256), torch.randn(slots, 1, 256)
        qt = torch.randn(n, G, 256)
        for t in (qt, kt, vt):
            t.view(-1)[::7] = TINY[1]
        cnt = torch.arange(171, 171 + n)
        out.append(kernels.attention(qt.bfloat16(), kt.bfloat16(), vt.bfloat16(), keys, torch.zeros(n, dtype=torch.int64),
                                     cnt, 0.0625, dtype=torch.float32))
    # wide heads in float32 and float16 (d 150: the value columns in groups of 64 and 16,
    # then a tail; keys taken two and four at a time, then one), decode-like rows
    for dt in (torch.float32, torch.float16):
        kp, vp = torch.randn(slots, 1, 150).to(dt), torch.randn(slots, 1, 150).to(dt)
        out.append(kernels.attention(torch.randn(3, 4, 150), kp, vp, keys[:103], torch.tensor([0, 40, 0]),
                                     torch.tensor([103, 61, 7]), 0.1))
    x = torch.randn(33, 130) * 3
    out.append(kernels.rms_norm(x, torch.randn(130), 1e-6))
    out.append(kernels.rms_norm(x, torch.randn(130), 1e-6, torch.bfloat16, residual=x.to(torch.bfloat16)))
    ang = torch.randn(33, 16)
    out.append(kernels.rope(x.view(33, 2, 65)[..., :64].contiguous(), torch.cat((ang.cos(), ang.cos()), -1),
                            torch.cat((-ang.sin(), ang.sin()), -1)))
    y = x.clone()
    y[3, 100], y[4, 7], y[5] = float("nan"), float("nan"), 2.0  # NaNs (first found), a row of ties
    out.append(torch.tensor([kernels.argmax(r) for r in y] + [kernels.argmax(torch.randn(1000) * 3)]))
    gh = kernels.GreedyHead(kernels.PackedWeight(torch.randn(45, 130) * 0.1))   # the greedy head's int8 bound
    for dt in (torch.float32, torch.bfloat16):
        out += [c if c is not None else torch.tensor([-1]) for c in gh.candidates((x[:9] * 2).to(dt), dt)]
    out += [gh.codes, gh.colsum, gh.s, gh.e, gh.w]
    out += [kernels.elementwise(op, x * 4, 20.0) for op in kernels.OPS]
    xb = (x * 4).bfloat16()                   # 16-bit inputs and outputs converted inside the calls
    out += [kernels.elementwise(op, xb, 20.0) for op in ("gelu_tanh", "silu")]
    out.append(kernels.elementwise("exp", xb.half()))
    out.append(kernels.rms_norm(xb, torch.randn(130), 1e-6, torch.bfloat16))
    out.append(kernels.rms_norm(x[:7], torch.randn(130), 1e-6, torch.bfloat16))
    out.append(kernels.rope(xb.view(33, 2, 65)[..., :64].contiguous(), torch.cat((ang.cos(), ang.cos()), -1).bfloat16(),
                            torch.cat((-ang.sin(), ang.sin()), -1).bfloat16()))
    return out


def compiler_targets(march: str) -> bool:
    """Whether the C compiler builds a trivial file for `march` (a skip is for a compiler
    that cannot target the level, never for kernels.c failing to build there: a path one
    level's build lacks must fail here, not go unseen)."""
    try:
        cc = kernels.build.compiler()
    except kernels.build.BuildError:
        return False
    done = subprocess.run([cc, f"-march={march}", "-x", "c", "-c", "-", "-o", os.devnull],
                          input=b"int f(void) { return 0; }\n", capture_output=True)
    return done.returncode == 0


@pytest.mark.parametrize("march", levels_below())
def test_every_instruction_set_gives_the_same_bits(march):
    here = every_kernel()
    try:
        other = kernels.isa(march)
    except kernels.build.BuildError as err:
        if compiler_targets(march):   # the compiler builds for the level: kernels.c itself failed there
            raise
        pytest.skip(f"the C compiler cannot build for {march}: {err}")
    with other:
        assert kernels.lib() is other.lib   # the other build runs: its own paths, named so
        assert kernels.lib().ur_isa().decode() == LEVELS[march]
        there = every_kernel()
    assert kernels.lib() is not other.lib
    assert len(here) == len(there)
    for i, (a, b) in enumerate(zip(here, there)):
        assert torch.equal(a, b), f"{march}: kernel case {i} differs by up to {(a - b).abs().max().item()}"


def test_weights_fused_into_one_product_give_each_part_its_own_bits():
    """kernels.fuse / ops.linears: q, k and v (or gate and up) multiplied as one product
    give each part's outputs bit for bit, the parts become views of the one storage
    (nothing held twice) and still multiply alone; what cannot be one stays apart."""
    from uniradix.model.hf.ops import linears
    torch.manual_seed(3)
    K = 256
    x = torch.randn(5, K)
    for dt in (torch.float32, torch.bfloat16):
        ws = [kernels.PackedWeight((torch.randn(n, K) * 0.1).to(dt)) for n in (64, 32, 40)]
        bs = [torch.randn(w.out_features) for w in ws]
        apart = [kernels.linear(x, w, b) for w, b in zip(ws, bs)]
        dense = [w.dense() for w in ws]
        together = linears(x, ws, bs)
        for a, b in zip(together, apart):
            assert torch.equal(a, b)
        fused_ptr = ws[0].panels.data_ptr()
        assert ws[1].panels.data_ptr() == fused_ptr + ws[0].panels.numel() * ws[0].panels.element_size()
        for w, d, b, a in zip(ws, dense, bs, apart):          # each part alone, as before
            assert torch.equal(w.dense(), d) and torch.equal(kernels.linear(x, w, b), a)
        assert [t.shape[-1] for t in linears(x[:1], ws, bs)] == [64, 32, 40]
        assert linears(x, ws[:2], [bs[0], None])[1].shape == (5, 32)       # a bias on some parts only: apart
    qs = [kernels.PackedQuant(decode(f, random_blocks(f, n, K, seed=seed), n, K), f)
          for f, n, seed in (("Q5_0", 64, 4), ("Q5_0", 34, 5), ("Q8_0", 32, 6), ("Q5_0", 36, 7))]
    apart = [kernels.linear_q(x, w) for w in qs]
    assert kernels.fuse([qs[0], qs[2]]) is None                             # two formats
    assert kernels.fuse([qs[1], qs[0]]) is None                             # 34 rows: a part panel mid-way
    together = linears(x, [qs[0], qs[3], qs[1]])                            # (last: it may end mid-panel)
    for a, b in zip(together, [apart[0], apart[3], apart[1]]):
        assert torch.equal(a, b)
    assert torch.equal(kernels.linear_q(x, qs[1]), apart[1])
    assert kernels.fuse([kernels.PackedWeight(torch.randn(16, K)), kernels.PackedWeight(torch.randn(16, K).bfloat16())]) is None
