"""The pools' row copies on the CPU in one C call a tensor (rows.c, built on first use by
uniradix.native): a layer-by-layer load moves each layer's pages at memcpy speed instead
of through a gather and a scatter. Where no compiler is found (or UNIRADIX_ROW_COPY=torch
asks), `copy` returns False and the caller copies with torch."""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import numpy as np
import torch

from ..native import BuildError, library

log = logging.getLogger("uniradix.memory")

_state: dict = {"tried": False, "fn": None}
_i64, _p = ctypes.c_int64, ctypes.c_void_p


def _load():
    _state["tried"] = True
    if os.environ.get("UNIRADIX_ROW_COPY", "").lower() == "torch":
        return None
    try:
        lib = ctypes.CDLL(library(Path(__file__).with_name("rows.c"),
                                  ["-O2", "-fPIC", "-shared", "-std=c11"], "uniradix_rows"))
    except (BuildError, OSError) as e:
        log.warning("row copies through torch (%s)", e)
        return None
    fn = lib.ur_copy_rows
    fn.argtypes, fn.restype = [_p, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _i64, _i64], None
    return fn


def available() -> bool:
    if not _state["tried"]:
        _state["fn"] = _load()
    return _state["fn"] is not None


def layout(src: torch.Tensor, dst: torch.Tensor, dim: int):
    """How `copy` moves rows along `dim` (0 or 1) of `src` into `dst`: (outer count, src
    outer stride, src row stride, dst outer stride, dst row stride, row bytes), all in
    bytes; None where it does not apply (not both on the CPU, dtypes or shapes apart, a
    row not contiguous in memory, no compiler)."""
    if (src.device.type != "cpu" or dst.device.type != "cpu" or src.dtype != dst.dtype or dim not in (0, 1)
            or src.dim() <= dim or dst.dim() != src.dim() or not available()):
        return None
    if src.shape[:dim] != dst.shape[:dim] or src.shape[dim + 1:] != dst.shape[dim + 1:]:
        return None
    inner = 1
    for k in range(src.dim() - 1, dim, -1):  # the dims after `dim`: one contiguous row
        if src.shape[k] != 1 and (src.stride(k) != inner or dst.stride(k) != inner):
            return None
        inner *= src.shape[k]
    e = src.element_size()
    outer = (src.shape[0], src.stride(0) * e, dst.stride(0) * e) if dim == 1 else (1, 0, 0)
    return outer[0], outer[1], src.stride(dim) * e, outer[2], dst.stride(dim) * e, inner * e


def bounds(idx: np.ndarray) -> tuple[int, int]:
    """(min, max) of an index array, for `check` (computed once for many copies)."""
    return (int(idx.min()), int(idx.max())) if len(idx) else (0, -1)


def check(src_rows: int, si_bounds: tuple[int, int], dst_rows: int, di_bounds: tuple[int, int]) -> None:
    """An IndexError unless every index lies in its tensor's rows: nothing out of range
    ever reaches memory."""
    (s0, s1), (d0, d1) = si_bounds, di_bounds
    if s0 < 0 or d0 < 0 or s1 >= src_rows or d1 >= dst_rows:
        raise IndexError(f"row copy: index out of range (rows {src_rows} and {dst_rows})")


def run(src: torch.Tensor, si: np.ndarray, dst: torch.Tensor, di: np.ndarray, lay) -> None:
    """The copy `layout` described, with indices already `check`ed: C-contiguous int64
    arrays of equal length, `di` without repeats."""
    n_outer, so, sr, do, dr, row = lay
    if len(si):
        _state["fn"](src.data_ptr(), so, sr, si.ctypes.data, dst.data_ptr(), do, dr, di.ctypes.data,
                     len(si), n_outer, row)


def copy(src: torch.Tensor, si: np.ndarray, dst: torch.Tensor, di: np.ndarray, dim: int) -> bool:
    """dst's rows `di` along `dim` (0 or 1) become src's rows `si`, in one C call; False,
    with nothing copied, where it does not apply (see `layout`). `si` and `di`:
    C-contiguous int64 arrays of equal length, `di` without repeats (the caller's check);
    an index out of range is an IndexError."""
    lay = layout(src, dst, dim)
    if lay is None or len(si) != len(di):
        return False
    check(src.shape[dim], bounds(si), dst.shape[dim], bounds(di))
    run(src, si, dst, di, lay)
    return True
