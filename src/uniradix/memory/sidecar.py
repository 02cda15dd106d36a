"""Per-handle extra tensors that ride along with a pool's handles.

A sidecar lets a layer kind attach data (scales, hashes, positions...) to
pages or slots without the tree knowing: it is indexed by the owner's
handles, zeroed when the owner hands a handle out, and copied with it.
"""

from __future__ import annotations

import math

import torch

from ._checks import pinned_ok, shape_tuple, torch_dtype

__all__ = ["SidecarPool"]


class SidecarPool:
    """An extra tensor ``[owner.size, *shape_per_handle]`` indexed by the
    owner's handles.  It gets its tensor (or none, if the owner is
    accounting-only) when registered with ``pool.register_sidecar``."""

    def __init__(self, name: str, shape_per_handle=(), dtype: torch.dtype = torch.float32,
                 device="cpu", *, pin_memory: bool = False):
        if not isinstance(name, str) or not name:
            raise ValueError(f"sidecar name must be a non-empty string, got {name!r}")
        self._name = name
        self._shape = shape_tuple(shape_per_handle, f"sidecar {name!r} shape_per_handle")
        self._dtype = torch_dtype(dtype, f"sidecar {name!r} dtype")
        self._device = torch.device(device)
        self._pin_memory = pinned_ok(pin_memory, self._device, f"sidecar {name!r}")
        self._owner = None
        self._num_handles = 0
        self._accounting_only = False
        self._tensor: torch.Tensor | None = None

    # -- description --------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def shape_per_handle(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def pin_memory(self) -> bool:
        return self._pin_memory

    @property
    def owner(self):
        """The pool this sidecar is registered on, or None."""
        return self._owner

    @property
    def num_handles(self) -> int:
        return self._num_handles

    @property
    def accounting_only(self) -> bool:
        return self._accounting_only

    @property
    def bytes_per_handle(self) -> int:
        return math.prod(self._shape) * self._dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Tensor bytes once registered (0 before), even if accounting-only."""
        return self._num_handles * self.bytes_per_handle

    @property
    def tensor(self) -> torch.Tensor:
        if self._owner is None:
            raise RuntimeError(f"sidecar {self._name!r} is not registered on a pool yet")
        if self._tensor is None:
            raise RuntimeError(
                f"sidecar {self._name!r} is accounting-only (its pool "
                f"{self._owner.name!r} holds no tensors)"
            )
        return self._tensor

    def __repr__(self) -> str:
        owner = None if self._owner is None else self._owner.name
        return (f"SidecarPool({self._name!r}, shape_per_handle={self._shape}, "
                f"dtype={self._dtype}, device={self._device}, owner={owner!r})")

    # -- used by the owning pool --------------------------------------------
    def _bind(self, owner, num_handles: int, accounting_only: bool) -> None:
        if self._owner is not None:
            raise ValueError(
                f"sidecar {self._name!r} is already registered on pool {self._owner.name!r}"
            )
        tensor = None
        if not accounting_only:
            tensor = torch.zeros((num_handles, *self._shape), dtype=self._dtype,
                                 device=self._device, pin_memory=self._pin_memory)
        self._owner = owner
        self._num_handles = num_handles
        self._accounting_only = accounting_only
        self._tensor = tensor

    def _zero_rows(self, rows: torch.Tensor) -> None:
        self._tensor.index_fill_(0, rows.to(self._device), 0)

    def _copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        t = self._tensor
        src = src.to(self._device)
        dst = dst.to(self._device)
        t.index_copy_(0, dst, t.index_select(0, src))

    def _copy_row(self, src: int, dst: int) -> None:
        self._tensor[dst].copy_(self._tensor[src])
