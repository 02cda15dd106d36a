"""The pools' row copies in C (memory/rows.c): the same bytes as torch's gather and
scatter along dims 0 and 1 in every dtype a pool holds, the rows around untouched, and
what it cannot copy (another device, rows apart in memory, dtypes or shapes apart)
declined so the caller copies with torch; an index out of range never reaches memory."""
import numpy as np
import pytest
import torch

from uniradix.memory import rows


def test_the_row_copy_builds_on_this_machine():
    assert rows.available(), "memory/rows.c did not build (a C compiler is part of the set-up)"


def _pair(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    return (torch.randint(-100, 100, shape, generator=g).to(dtype),
            torch.randint(-100, 100, shape, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64])
@pytest.mark.parametrize("dim", [0, 1])
def test_rows_copied_as_torch_copies_them(dim, dtype):
    shape = (3, 11, 4, 5) if dim == 1 else (11, 4, 5)
    src, dst = _pair(shape, dtype, 0)
    rng = np.random.default_rng(1)
    si = rng.choice(11, 6, replace=False).astype(np.int64)
    di = rng.choice(11, 6, replace=False).astype(np.int64)
    want = dst.clone()
    want.index_copy_(dim, torch.from_numpy(di), src.index_select(dim, torch.from_numpy(si)))
    assert rows.copy(src, si, dst, di, dim)
    assert dst.view(torch.uint8).equal(want.view(torch.uint8)) if dtype.itemsize == 1 else torch.equal(
        dst.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def test_a_view_with_strided_rows_is_copied_in_place():
    """A layer's rows (t[i] of [layers, size, ...]) and rows with a gap between them."""
    base_s, base_d = _pair((2, 9, 3, 8), torch.float32, 2)
    src, dst = base_s[1], base_d[0]            # views into bigger tensors
    gap_s, gap_d = _pair((9, 2, 24), torch.float32, 3)
    si, di = np.array([4, 0, 7], np.int64), np.array([1, 8, 2], np.int64)
    for s, d in ((src, dst), (gap_s[:, 0], gap_d[:, 1])):
        around = d.clone()
        want = d.clone().index_copy_(0, torch.from_numpy(di), s.index_select(0, torch.from_numpy(si)))
        assert rows.copy(s, si, d, di, 0)
        assert torch.equal(d, want)
        assert torch.equal(d[[0, 3, 4, 5, 6, 7]], around[[0, 3, 4, 5, 6, 7]])
    assert torch.equal(base_d[1], _pair((2, 9, 3, 8), torch.float32, 2)[1][1])  # the other layer untouched


def test_what_it_cannot_copy_is_declined_untouched():
    src, dst = _pair((6, 4, 4), torch.float32, 4)
    si = di = np.array([0, 1], np.int64)
    before = dst.clone()
    assert not rows.copy(src, si, dst.to(torch.bfloat16), di, 0)           # dtypes apart
    assert not rows.copy(src, si, torch.zeros(6, 4, 5), di, 0)              # row shapes apart
    assert not rows.copy(src.transpose(1, 2), si, dst.transpose(1, 2), di, 0)  # a row not contiguous
    assert not rows.copy(src, si, dst, di, 2)                               # only dims 0 and 1
    assert torch.equal(dst, before)


def test_an_index_out_of_range_is_an_error_not_a_write():
    src, dst = _pair((5, 8), torch.float32, 5)
    before = dst.clone()
    for si, di in (([0, 5], [1, 2]), ([0, 1], [1, -1]), ([0, 1], [9, 2])):
        with pytest.raises(IndexError):
            rows.copy(src, np.array(si, np.int64), dst, np.array(di, np.int64), 0)
    assert torch.equal(dst, before)


def test_torch_copies_when_asked(monkeypatch):
    monkeypatch.setenv("UNIRADIX_ROW_COPY", "torch")
    monkeypatch.setattr(rows, "_state", {"tried": False, "fn": None})
    src, dst = _pair((4, 3), torch.float32, 6)
    assert not rows.available()
    assert not rows.copy(src, np.array([0], np.int64), dst, np.array([1], np.int64), 0)
