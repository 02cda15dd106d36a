"""Argument validation shared by the pools (clear errors at construction
beat shape errors deep inside a kernel)."""

from __future__ import annotations

from operator import index as _as_int

import torch


def positive_int(value, what: str) -> int:
    try:
        value = _as_int(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r}") from None
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {value}")
    return value


def shape_tuple(shape, what: str) -> tuple[int, ...]:
    """A tuple of positive ints; a bare int means a 1-D shape, () a scalar."""
    if not hasattr(shape, "__iter__"):
        shape = (shape,)
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"{what} must be a tuple of ints, got {shape!r}")
    try:
        dims = tuple(_as_int(d) for d in shape)
    except TypeError:
        raise TypeError(f"{what} must be a tuple of ints, got {shape!r}") from None
    if any(d <= 0 for d in dims):
        raise ValueError(f"{what} must have positive dimensions, got {dims}")
    return dims


def torch_dtype(dtype, what: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what} must be a torch.dtype, got {dtype!r}")
    return dtype


def layer_id_tuple(layer_ids, what: str) -> tuple[int, ...]:
    if isinstance(layer_ids, (str, bytes)) or not hasattr(layer_ids, "__iter__"):
        raise TypeError(f"{what}: layer_ids must be an iterable of ints, got {layer_ids!r}")
    try:
        ids = tuple(_as_int(i) for i in layer_ids)
    except TypeError:
        raise TypeError(f"{what}: layer_ids must be ints, got {layer_ids!r}") from None
    if not ids:
        raise ValueError(f"{what}: layer_ids must not be empty")
    if any(i < 0 for i in ids):
        raise ValueError(f"{what}: layer ids must be non-negative, got {ids}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what}: duplicate layer ids in {ids}")
    return ids


def pinned_ok(pin_memory, device: torch.device, what: str) -> bool:
    """Only host memory can be pinned; say so here rather than deep inside torch."""
    pin_memory = bool(pin_memory)
    if pin_memory and device.type != "cpu":
        raise ValueError(f"{what}: pin_memory applies to host (cpu) memory, not {device}")
    return pin_memory
