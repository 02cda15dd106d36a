"""A handle's data as bytes and back: what a pool holds for one page or slot across
all its layers (K and V; conv and recurrent state), and a sidecar's row. The byte
layout is the tensors' own (raw little-endian elements, any dtype, bf16 included), in
the order the pool lists them; the receiving pool must have the same shapes."""
from __future__ import annotations

import torch


def handle_nbytes(pool) -> int:
    return sum(t[:, 0].numel() * t.element_size() for t in pool.handle_tensors())


def read_handles(pool, handles) -> list[bytes]:
    """One bytes object per handle: each of the pool's tensors' ``[:, h]``, concatenated."""
    idx = torch.as_tensor(list(handles), dtype=torch.long, device=pool.device)
    parts = [t.index_select(1, idx).transpose(0, 1).contiguous().view(len(idx), -1)
             .view(torch.uint8).cpu() for t in pool.handle_tensors()]
    rows = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    return [rows[i].numpy().tobytes() for i in range(len(idx))]


def write_handles(pool, handles, blobs: list[bytes]) -> None:
    """Inverse of read_handles; every blob must be exactly handle_nbytes(pool) long."""
    handles = list(handles)
    if len(handles) != len(blobs):
        raise ValueError(f"{len(handles)} handles but {len(blobs)} blobs")
    if not handles:
        return
    n = handle_nbytes(pool)
    bad = [len(b) for b in blobs if len(b) != n]
    if bad:
        raise ValueError(f"{pool.name}: a handle holds {n} bytes, got blobs of {bad[:3]} bytes")
    rows = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).view(len(handles), n)
    idx = torch.as_tensor(handles, dtype=torch.long, device=pool.device)
    off = 0
    for t in pool.handle_tensors():
        per = t[:, 0].numel() * t.element_size()
        part = rows[:, off:off + per].contiguous().view(t.dtype).view(len(handles), *t[:, 0].shape)
        t.index_copy_(1, idx, part.transpose(0, 1).to(t.device))
        off += per


def read_sidecar_rows(sidecar, handles) -> list[bytes]:
    idx = torch.as_tensor(list(handles), dtype=torch.long, device=sidecar.device)
    rows = sidecar.tensor.index_select(0, idx).contiguous().view(len(idx), -1).view(torch.uint8).cpu()
    return [rows[i].numpy().tobytes() for i in range(len(idx))]


def write_sidecar_rows(sidecar, handles, blobs: list[bytes]) -> None:
    handles = list(handles)
    if len(handles) != len(blobs):
        raise ValueError(f"{len(handles)} handles but {len(blobs)} blobs")
    if not handles:
        return
    t = sidecar.tensor
    n = t[0].numel() * t.element_size()
    bad = [len(b) for b in blobs if len(b) != n]
    if bad:
        raise ValueError(f"sidecar {sidecar.name}: a row holds {n} bytes, got {bad[:3]}")
    rows = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).view(len(handles), n)
    idx = torch.as_tensor(handles, dtype=torch.long, device=t.device)
    t.index_copy_(0, idx, rows.view(t.dtype).view(len(handles), *t.shape[1:]).to(t.device))
