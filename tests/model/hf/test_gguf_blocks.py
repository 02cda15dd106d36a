"""A GGUF's quantized blocks read as stored: gguf_blocks.decode gives, for every format
it reads, codes and scales whose dequantisation is bit for bit the `gguf` library's;
kernels.PackedQuant keeps them packed, a lookup gives the library's values, and its
product (activations rounded to 8 bits per block of 32, integer dots, as llama.cpp)
is within that rounding of the float32 product over the library's dequantised weights,
and the same bits whatever rows are computed beside a row."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as library_dequantize

from uniradix.model import kernels
from uniradix.model.hf.gguf_blocks import decode, dequantize

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the row-invariant kernels are not built here")


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random codes with finite, modest float16 scales and offsets, as a file's bytes."""
    rng = np.random.default_rng(seed)
    qt = getattr(gguf.GGMLQuantizationType, name)
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    scale_at = [208] if name == "Q6_K" else [0, 2] if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0]
    for at in scale_at:
        v = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, at:at + 2] = v.view(np.uint8).reshape(-1, 2)
    return raw


def library(name: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    return library_dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).reshape(n, k).astype(np.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_codes_dequantize_to_the_librarys_values_bit_for_bit(name):
    n, k = 12, 512
    raw = random_blocks(name, n, k)
    codes = decode(name, raw, n, k)
    assert codes.u.shape == (n, k) and codes.a.shape == (n, k // codes.group)
    assert np.array_equal(dequantize(codes).view(np.uint32), library(name, raw, n, k).view(np.uint32))


def test_a_format_not_read_here_is_none():
    assert decode("Q2_K", np.zeros(84, np.uint8), 1, 256) is None


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
def test_packed_blocks_multiply_row_invariantly_within_the_activations_rounding(name):
    n, k = 45, 512   # 45 rows: the last panel padded
    raw = random_blocks(name, n, k, seed=1)
    ref = torch.from_numpy(library(name, raw, n, k))
    packed = kernels.PackedQuant(decode(name, raw, n, k), name)
    assert packed.shape == (n, k) and packed.nbytes() < ref.numel() * 2   # codes and float32 scales: under 16 bits a weight
    assert torch.equal(packed.dense(), ref)
    ids = torch.tensor([[3, 44], [0, 3]])
    assert torch.equal(packed[ids], ref[ids])                                  # a lookup reads the blocks
    x = torch.randn(70, k)   # 70 rows: AMX's blocks of 16 outside the panels (64 rows on), a short last block
    x[5] = 0.0                                                                 # a row of zeros: no scale to divide by
    bias = torch.randn(n)
    y = kernels.linear_q(x, packed, bias)
    exact = (x.double() @ ref.double().T + bias.double())
    # 8-bit activations: each block's rounding is at most half a step of max|x| / 127
    bound = (x.abs().double() @ ref.abs().double().T) / 127
    assert ((y.double() - exact).abs() <= bound + 1e-4 * exact.abs() + 1e-6).all()
    assert torch.equal(y[5], bias)
    for m in (1, 2, 3, 5, 7, 16, 17, 20):   # a row's values whatever rows are computed beside it (17, 20: a few past a tile)
        assert torch.equal(torch.cat([kernels.linear_q(x[i:i + m], packed, bias) for i in range(0, 70, m)]), y)
    with kernels.no_amx():                                                     # with AMX's tiles (16 rows on) or not
        assert torch.equal(kernels.linear_q(x, packed, bias), y)
    with torch.no_grad():
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(kernels.linear_q(x, packed, bias), y)             # and however many threads
        finally:
            torch.set_num_threads(threads)
    xb = x.bfloat16()                              # 16-bit rows, converted (exactly) inside the call
    yb = kernels.linear_q(xb, packed, bias)
    assert yb.dtype is torch.bfloat16 and torch.equal(yb, kernels.linear_q(xb.float(), packed, bias).bfloat16())
    wide = torch.randn(70, 3 * k).bfloat16()
    wide[:, k:2 * k] = xb                          # rows 3k apart: read where they lie
    assert torch.equal(kernels.linear_q(wide[:, k:2 * k], packed, bias), yb)
    assert torch.equal(kernels.linear_q(xb.half(), packed, bias), kernels.linear_q(xb.half().float(), packed, bias).half())
    with pytest.raises(ValueError, match="features"):
        kernels.linear_q(torch.randn(2, k + 1), packed)


@needs_kernels
@pytest.mark.parametrize("name", ["Q4_K", "Q5_0", "Q8_0"])
def test_a_wide_weight_multiplies_the_same_in_sweeps_of_panels(name):
    """Over AMX a prefill chunk takes the panels in sweeps of about 1 MB of codes (a large
    weight is read from memory once): 2,085 weight rows (several sweeps, the last panel
    padded) give each row the values it has alone, with one thread or two, with the tiles
    or without."""
    n, k = 16 * 130 + 5, 512
    packed = kernels.PackedQuant(decode(name, random_blocks(name, n, k, seed=2), n, k), name)
    x = torch.randn(70, k)
    y = kernels.linear_q(x, packed)
    assert torch.equal(torch.cat([kernels.linear_q(x[i:i + 16], packed) for i in range(0, 70, 16)]), y)
    assert torch.equal(kernels.linear_q(x[3:4], packed)[0], y[3])
    with kernels.no_amx():
        assert torch.equal(kernels.linear_q(x, packed), y)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(kernels.linear_q(x, packed), y)
    finally:
        torch.set_num_threads(threads)
