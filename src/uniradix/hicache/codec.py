"""A handle's data as bytes and back: what a pool holds for one page or slot across
all its layers (K and V; conv and recurrent state), and a sidecar's row. The byte
layout is the tensors' own (raw little-endian elements, any dtype, bf16 included), in
the order the pool lists them; the receiving pool must have the same shapes.

A pool's buffers are ``[num_layers, size, ...]`` (the handle on dim 1); a sidecar's is
``[size, ...]`` (dim 0). Both go through the same two functions below."""
from __future__ import annotations

import torch


def _pool_rows(pool) -> list[tuple[torch.Tensor, int]]:
    """A pool that only counts (the FULL pool of a model with no full-attention layer)
    has no rows: its handles are empty bytes, so it travels through the tiers like any."""
    if getattr(pool, "accounting_only", False):
        return []
    return [(t, 1) for t in pool.handle_tensors()]


def _sidecar_rows(sidecar) -> list[tuple[torch.Tensor, int]]:
    return [(sidecar.tensor, 0)]


def _row_nbytes(parts) -> int:
    return sum(t.select(dim, 0).numel() * t.element_size() for t, dim in parts)


def handle_nbytes(pool) -> int:
    return _row_nbytes(_pool_rows(pool))


def sidecar_row_nbytes(sidecar) -> int:
    return _row_nbytes(_sidecar_rows(sidecar))


def _read(parts, handles, device) -> list[bytes]:
    """One bytes object per handle: each tensor's row for it, concatenated."""
    if not parts:
        return [b""] * len(handles)
    idx = torch.as_tensor(list(handles), dtype=torch.long, device=device)
    rows = torch.cat([t.index_select(dim, idx).movedim(dim, 0).contiguous().view(len(idx), -1)
                      .view(torch.uint8).cpu() for t, dim in parts], dim=1)
    return [rows[i].numpy().tobytes() for i in range(len(idx))]


def _write(parts, handles, blobs: list[bytes], device, what: str) -> None:
    handles = list(handles)
    if len(handles) != len(blobs):
        raise ValueError(f"{len(handles)} handles but {len(blobs)} blobs")
    if not handles:
        return
    n = _row_nbytes(parts)
    bad = [len(b) for b in blobs if len(b) != n]
    if bad:
        raise ValueError(f"{what}: a handle holds {n} bytes, got blobs of {bad[:3]} bytes")
    if not parts:
        return
    rows = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).view(len(handles), n)
    idx = torch.as_tensor(handles, dtype=torch.long, device=device)
    off = 0
    for t, dim in parts:
        shape = t.select(dim, 0).shape
        per = shape.numel() * t.element_size()
        part = rows[:, off:off + per].contiguous().view(t.dtype).view(len(handles), *shape)
        t.index_copy_(dim, idx, part.movedim(0, dim).to(t.device))
        off += per


def read_handles(pool, handles) -> list[bytes]:
    """One bytes object per handle: each of the pool's tensors' ``[:, h]``, concatenated."""
    return _read(_pool_rows(pool), handles, pool.device)


def write_handles(pool, handles, blobs: list[bytes]) -> None:
    """Inverse of read_handles; every blob must be exactly handle_nbytes(pool) long."""
    _write(_pool_rows(pool), handles, blobs, pool.device, pool.name)


def read_sidecar_rows(sidecar, handles) -> list[bytes]:
    return _read(_sidecar_rows(sidecar), handles, sidecar.device)


def write_sidecar_rows(sidecar, handles, blobs: list[bytes]) -> None:
    _write(_sidecar_rows(sidecar), handles, blobs, sidecar.device, f"sidecar {sidecar.name}")
