"""The host tier (L2): a CPU pool that mirrors a device pool's layout, the one copy that
moves handles' data between two such pools (whole, or one layer at a time so a load can
run under the forward), and the host sizes that SGLang's --hicache-ratio / --hicache-size
give."""

from __future__ import annotations


import numpy as np
import torch

from ..config import finite_number
from .budget import handle_count
from .kv import KVPool
from .mamba import MambaStatePool
from . import rows as _rows
from .pool import HandlePool
from .sidecar import SidecarPool

__all__ = ["HandleCopy", "copy_handles", "host_mirror", "host_sizes"]


def host_mirror(pool, size: int, *, pin_memory: bool | None = None):
    """A CPU pool of ``pool``'s class, name, layers, shapes, dtypes and sidecars, with
    ``size`` handles; accounting-only if ``pool`` is. Pinned by default when ``pool``
    lives on a CUDA device, so host-to-device copies can be asynchronous."""
    if pin_memory is None:
        pin_memory = pool.device.type == "cuda" and torch.cuda.is_available()
    common = dict(device="cpu", accounting_only=pool.accounting_only, name=pool.name,
                  pin_memory=pin_memory)
    if isinstance(pool, KVPool):
        mirror = type(pool)(pool.layer_ids, size, pool.page_size, pool.num_kv_heads,
                            pool.head_dim, pool.dtype, **common)
    elif isinstance(pool, MambaStatePool):
        mirror = type(pool)(pool.layer_ids, size, layer_shapes=pool.layer_shapes, **common)
    else:
        raise TypeError(f"host_mirror: expected a KVPool or MambaStatePool, got {type(pool).__name__}")
    for sc in pool.sidecars.values():
        mirror.register_sidecar(SidecarPool(sc.name, sc.shape_per_handle, sc.dtype, "cpu",
                                            pin_memory=pin_memory))
    return mirror


def copy_handles(src, src_handles, dst, dst_handles, layer_id=None, *,
                 non_blocking: bool = False) -> None:
    """Copy what ``src_handles[i]`` holds in ``src`` into ``dst_handles[i]`` of ``dst``
    (any devices): every row of the pools' own tensors and of every sidecar.

    With ``layer_id``, only that layer's rows of the pools' tensors; the sidecars ride with
    the pools' first layer id, so copying layer by layer over all layers copies each row
    once. Both sides' handles must be allocated (writing a free handle would write memory
    someone else may soon own) and a destination may appear only once. ``non_blocking``
    makes host-to-device copies asynchronous on the current stream (the caller orders
    readers after it); device-to-host copies are always complete on return."""
    HandleCopy(src, src_handles, dst, dst_handles).run(layer_id, non_blocking=non_blocking)


def host_sizes(pools: dict, *, ratio: float = 2.0, size_gb: float | None = None) -> dict[str, int]:
    """Host handle counts per pool name. ``ratio`` times each device pool's handles, or,
    when ``size_gb`` is given, the ratio that fills ``size_gb`` GiB with the pools that
    hold tensors (accounting-only pools follow the same ratio). The host tier must be
    larger than the device tier: a host copy of everything on the device is the point.
    ``pools`` may be pools or plans of them (anything with ``size``, ``nbytes`` and
    ``accounting_only``), so the sizes can be checked before anything is allocated."""
    if size_gb is not None:
        flags = ("--hicache-size",)
        if not (finite_number(size_gb) and size_gb > 0):
            raise ValueError(f"--hicache-size must be a positive number of GB, got {size_gb!r}")
        asked = size_gb * 2**30
        device_bytes = sum(p.nbytes for p in pools.values() if not p.accounting_only)
        if device_bytes == 0:
            raise ValueError("--hicache-size needs pools that hold tensors (these are "
                             "accounting-only); use --hicache-ratio instead")
        ratio = asked / device_bytes
        if ratio <= 1:
            raise ValueError(
                f"--hicache-size {size_gb} GB ({int(asked)} bytes) must be larger than the device "
                f"tier ({device_bytes} bytes): the host tier must be larger than the device tier")
    elif finite_number(ratio) and ratio > 1:
        flags = ("--hicache-ratio",)
    else:
        raise ValueError(f"--hicache-ratio must be greater than 1 (the host tier must be larger "
                         f"than the device tier), got {ratio!r}")
    # a ratio of 1e300 makes inf handles: count them as floats, refuse before int()
    return {name: handle_count(max(p.size * ratio, p.size + 1),
                               f"the host copy of {getattr(p, 'what', f'pool {name!r}')}",
                               getattr(p, "unit", "handles"), flags)
            for name, p in pools.items()}


class HandleCopy:
    """`copy_handles` split in two: the checks (and a snapshot of the handles) when built,
    the copy on `run(layer_id=None, non_blocking=False)`, as often as needed. A layerwise
    load checks on the caller's thread and runs each layer on its own thread; device
    index tensors are made once per device, by the thread that runs the copy."""

    def __init__(self, src, src_handles, dst, dst_handles):
        _check_same_layout(src, dst)
        si = src.allocator.require_allocated(src_handles, f"copy source in {src.kind} {src.name!r}")
        di = dst.allocator.require_allocated(dst_handles,
                                             f"copy destination in {dst.kind} {dst.name!r}")
        if si.shape[0] != di.shape[0]:
            raise ValueError(f"copy {src.name!r}: {si.shape[0]} source handles but "
                             f"{di.shape[0]} destination handles")
        if np.unique(di).shape[0] != di.shape[0]:
            raise ValueError(f"copy {dst.name!r}: a destination handle is listed more than once")
        self.src, self.dst = src, dst
        self._handles = {"src": si.astype(np.int64), "dst": di.astype(np.int64)}
        self._rows: dict = {}  # the C row copies' plan per layer id (None: whole handles)
        self._index: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.empty = si.shape[0] == 0 or src.accounting_only

    def run(self, layer_id=None, *, non_blocking: bool = False) -> None:
        if layer_id is not None:
            self.src._layer(layer_id)  # the error for a layer the pool does not hold
        if self.empty:
            return
        plan = self._rows.get(layer_id)
        if plan is None:
            plan = self._rows[layer_id] = self._row_plan(self._parts(layer_id))
        if plan:
            si, di = self._handles["src"], self._handles["dst"]
            for s, d, lay in plan:
                _rows.run(s, si, d, di, lay)
            return
        for s, d, dim in self._parts(layer_id):
            self._move(s, d, dim, non_blocking)

    def _parts(self, layer_id) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(source, destination, the dim handles index) of every tensor this run copies:
        the whole handles of the pools' buffers, or one layer's rows of them (the pool
        says where a layer lies: layers of different shapes live in buffers of their
        own); the sidecars with the first layer."""
        src, dst = self.src, self.dst
        if layer_id is None:
            parts = [(s, d, 1) for s, d in zip(src.handle_tensors(), dst.handle_tensors())]
        else:
            parts = [(s, d, 0) for s, d in zip(src.layer_tensors(layer_id), dst.layer_tensors(layer_id))]
        if layer_id is None or layer_id == src.layer_ids[0]:
            parts += [(sc.tensor, dst.sidecars[name].tensor, 0) for name, sc in src.sidecars.items()]
        return parts

    def _row_plan(self, parts):
        """Both pools on the CPU: each tensor's rows copied by one C call (memory/rows.c),
        its layout and the indices' bounds checked once a layer a load; False where one
        does not apply (torch copies instead)."""
        plan = [(s, d, _rows.layout(s, d, dim)) for s, d, dim in parts]
        if any(lay is None for *_, lay in plan):
            return False
        sb, db = (_rows.bounds(self._handles[side]) for side in ("src", "dst"))
        for s, d, dim in parts:
            _rows.check(s.shape[dim], sb, d.shape[dim], db)
        return plan

    def _idx(self, side: str, device: torch.device) -> torch.Tensor:
        t = self._index.get((side, device))
        if t is None:
            t = torch.from_numpy(self._handles[side])
            if device.type == "cuda":
                # from pinned memory, queued on the current stream: a blocking copy would
                # synchronise that stream (a load's side stream waits on the compute stream)
                t = t.pin_memory().to(device, non_blocking=True)
            self._index[(side, device)] = t = t.to(device)
        return t

    def _move(self, s: torch.Tensor, d: torch.Tensor, dim: int, non_blocking: bool) -> None:
        si, di = self._idx("src", s.device), self._idx("dst", d.device)
        if s.device == d.device:
            rows = s.index_select(dim, si)
        elif non_blocking and s.device.type == "cpu":
            # gather into pinned memory: only a copy from pinned memory is truly asynchronous
            shape = list(s.shape)
            shape[dim] = si.shape[0]
            rows = torch.index_select(s, dim, si, out=torch.empty(shape, dtype=s.dtype,
                                                                  pin_memory=True))
            rows = rows.to(d.device, non_blocking=True)
        else:
            # a scatter on the host must see the rows, so this copy completes here
            rows = s.index_select(dim, si).to(d.device)
        d.index_copy_(dim, di, rows)


def _check_same_layout(src, dst) -> None:
    for p in (src, dst):
        if not isinstance(p, HandlePool):
            raise TypeError(f"copy: expected pools, got {type(p).__name__}")
    what = f"copy {src.kind} {src.name!r} -> {dst.kind} {dst.name!r}"
    if src.layer_ids != dst.layer_ids:
        raise ValueError(f"{what}: layer ids differ ({list(src.layer_ids)} vs {list(dst.layer_ids)})")
    if src.accounting_only != dst.accounting_only:
        raise ValueError(f"{what}: one pool is accounting-only, the other holds tensors")
    if not src.accounting_only:
        s_spec = [(t.shape[:1] + t.shape[2:], t.dtype) for t in src.handle_tensors()]
        d_spec = [(t.shape[:1] + t.shape[2:], t.dtype) for t in dst.handle_tensors()]
        if s_spec != d_spec:
            raise ValueError(f"{what}: per-handle shapes/dtypes differ ({_spec(s_spec)} vs {_spec(d_spec)})")
    s_sc = {n: (sc.shape_per_handle, sc.dtype) for n, sc in src.sidecars.items()}
    d_sc = {n: (sc.shape_per_handle, sc.dtype) for n, sc in dst.sidecars.items()}
    if s_sc != d_sc:
        raise ValueError(f"{what}: sidecars differ ({s_sc} vs {d_sc})")


def _spec(spec) -> str:
    return ", ".join(f"{tuple(shape)} {dtype}" for shape, dtype in spec)
