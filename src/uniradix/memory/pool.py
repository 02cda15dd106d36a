"""What every handle-indexed pool shares: an allocator, sidecars, and the
accounting-only switch that lets a simulator run the cache with no memory."""

from __future__ import annotations

import math
from array import array
from operator import index as _as_int
from types import MappingProxyType

import numpy as np
import torch

from ._checks import layer_id_tuple, pinned_ok, positive_int
from .allocator import HandleAllocator
from .sidecar import SidecarPool

__all__ = ["HandlePool"]


def index_tensor(idx: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(idx.astype(np.int64))
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


class HandlePool:
    """Base for pools whose rows are indexed by allocator handles.

    Subclasses describe their buffers in ``handle_rows`` (one layer's row of each
    buffer for one handle) and allocate them with ``_zeros`` only when
    ``accounting_only`` is false; what a handle costs follows from the same rows
    (``bytes_per_handle_for``), so a size can be checked before a pool exists.
    """

    kind = "HandlePool"

    def __init__(self, size: int, *, name: str, layer_ids, device="cpu",
                 accounting_only: bool = False, pin_memory: bool = False):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        size = positive_int(size, f"{self.kind} {name!r} size")
        self._name = name
        self._layer_ids = layer_id_tuple(layer_ids, f"{self.kind} {name!r}")
        self._layer_index = {lid: i for i, lid in enumerate(self._layer_ids)}
        self._device = torch.device(device)
        self._accounting_only = bool(accounting_only)
        self._pin_memory = pinned_ok(pin_memory, self._device, f"{self.kind} {name!r}")
        self._allocator = HandleAllocator(size, name)
        self._sidecars: dict[str, SidecarPool] = {}
        self._live_sidecars: list[SidecarPool] = []

    # -- description --------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self._layer_ids

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def accounting_only(self) -> bool:
        return self._accounting_only

    @property
    def pin_memory(self) -> bool:
        """Whether the buffers are page-locked host memory (fast async copies to a device)."""
        return self._pin_memory

    @property
    def allocator(self) -> HandleAllocator:
        return self._allocator

    @property
    def size(self) -> int:
        return self._allocator.size

    @property
    def sidecars(self):
        """Registered sidecars by name (read-only view)."""
        return MappingProxyType(self._sidecars)

    @property
    def bytes_per_handle(self) -> int:
        """Bytes one handle costs across all layers, sidecars included."""
        return self._own_bytes_per_handle() + sum(
            s.bytes_per_handle for s in self._sidecars.values())

    @property
    def nbytes(self) -> int:
        """Total tensor bytes (computed from shapes, also when accounting-only)."""
        return self.size * self.bytes_per_handle

    @staticmethod
    def handle_rows(**shape) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of one layer's row, for one handle, of each buffer the
        constructor allocates with these shape arguments (each buffer is
        ``[num_layers, size, *row]``)."""
        raise NotImplementedError

    @classmethod
    def bytes_per_handle_for(cls, num_layers: int, **shape) -> int:
        """Tensor bytes one handle of a pool built with ``shape`` (the constructor's
        shape and dtype arguments) costs over ``num_layers`` layers, sidecars aside;
        what the constructor allocates, priced before anything is."""
        return num_layers * sum(math.prod(row) * dtype.itemsize
                                for row, dtype in cls.handle_rows(**shape))

    def _own_bytes_per_handle(self) -> int:
        return self.bytes_per_handle_for(len(self._layer_ids), **self._shape)

    def _zeros(self) -> list[torch.Tensor]:
        """The buffers ``handle_rows`` describes, zeroed (for pools that hold tensors)."""
        lead = (len(self._layer_ids), self.size)
        return [torch.zeros((*lead, *row), dtype=dtype, device=self._device,
                            pin_memory=self._pin_memory)
                for row, dtype in self.handle_rows(**self._shape)]

    def handle_tensors(self) -> list[torch.Tensor]:
        """The pool's own buffers, each ``[num_layers, size, ...]``: what one handle
        owns is ``t[:, h]`` of each. Tiers copy handles through these."""
        self._require_tensors()
        return self._handle_tensors()

    def _handle_tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def layer_tensors(self, layer_id) -> list[torch.Tensor]:
        """One layer's rows of each buffer, each ``[size, ...]``: what a layer-by-layer
        copy moves for that layer."""
        i = self._layer(layer_id)
        return [t[i] for t in self.handle_tensors()]

    # -- accounting ---------------------------------------------------------
    @property
    def available(self) -> int:
        return self._allocator.available

    @property
    def used(self) -> int:
        return self._allocator.used

    def alloc(self, n: int) -> array:
        """Take ``n`` handles (all or nothing); their sidecar rows are zeroed."""
        handles = self._allocator.alloc(n)
        if self._live_sidecars and handles:
            try:
                rows = index_tensor(np.frombuffer(handles, dtype=np.int32), self._device)
                for sc in self._live_sidecars:
                    sc._zero_rows(rows)
            except BaseException:
                self._allocator.free(handles)
                raise
        return handles

    def free(self, handles) -> None:
        self._allocator.free(handles)

    def is_allocated(self, handle: int) -> bool:
        return self._allocator.is_allocated(handle)

    def register_sidecar(self, sidecar: SidecarPool) -> SidecarPool:
        """Attach ``sidecar``, sized to this pool's handle count; returns it."""
        if not isinstance(sidecar, SidecarPool):
            raise TypeError(f"expected a SidecarPool, got {type(sidecar).__name__}")
        if sidecar.name in self._sidecars:
            raise ValueError(f"{self.kind} {self._name!r} already has a sidecar "
                             f"named {sidecar.name!r}")
        sidecar._bind(self, self.size, self._accounting_only)
        self._sidecars[sidecar.name] = sidecar
        if not self._accounting_only:
            self._live_sidecars.append(sidecar)
        return sidecar

    # -- helpers for subclasses ---------------------------------------------
    def _layer(self, layer_id) -> int:
        try:
            return self._layer_index[layer_id]
        except (KeyError, TypeError):
            raise KeyError(
                f"layer {layer_id!r} is not in {self.kind} {self._name!r} "
                f"(layers {list(self._layer_ids)})"
            ) from None

    def _require_tensors(self) -> None:
        if self._accounting_only:
            raise RuntimeError(
                f"{self.kind} {self._name!r} is accounting-only: it holds no tensors"
            )

    def _slot(self, handle, what: str) -> int:
        h = _as_int(handle)
        if not self._allocator.is_allocated(h):
            raise ValueError(f"{what}: {self._name}: handle {h} is not allocated")
        return h

    def __repr__(self) -> str:
        mode = ", accounting_only" if self._accounting_only else ""
        return (f"{type(self).__name__}({self._name!r}, size={self.size}, "
                f"used={self.used}, layers={len(self._layer_ids)}{mode})")
