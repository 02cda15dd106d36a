"""Whether pools of given sizes fit the memory where they will live, asked before
anything is allocated: a pool too large for its device otherwise costs a long wait
(building an allocator of 10**8 handles) and then an out-of-memory error, or a
machine that swaps, neither of which names the flag to change."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from .allocator import HandleAllocator
from .sidecar import SidecarPool

__all__ = ["USABLE_FRACTION", "PoolPlan", "available_bytes", "check_fits", "format_bytes",
           "handle_count", "host_available_bytes"]

#: the share of a device's available memory all pools together may take: the model,
#: activations and whatever else runs there need the rest
USABLE_FRACTION = 0.9

_CPU = torch.device("cpu")


def handle_count(n, what: str, unit: str, flags: tuple[str, ...]) -> int:
    """``n`` handles as an int, refused (naming ``flags``) when one pool could not
    index them; ``n`` may be a float from a ratio, even inf."""
    if not n <= HandleAllocator.MAX_SIZE:
        raise ValueError(f"{what} would hold {n:.4g} {unit}, more than the "
                         f"{HandleAllocator.MAX_SIZE} one pool can index{_sized_by(flags)}: "
                         f"{_fix(flags)}")
    return int(n)


def _sized_by(flags) -> str:
    return f" ({', '.join(flags)})" if flags else ""


def _fix(flags) -> str:
    return f"lower {' or '.join(flags)}" if flags else "make it smaller"


@dataclass(frozen=True)
class PoolPlan:
    """A pool before it exists: its class, layers, handle count and the constructor's
    shape arguments, so what it will cost comes from the class's own formula
    (``bytes_per_handle_for``) and ``build()`` makes exactly that pool. ``what``,
    ``unit`` and ``flags`` say in an error which pool it is and which flags size it.
    Has the ``size``, ``nbytes`` and ``accounting_only`` that ``host_sizes`` reads."""

    name: str
    pool_class: type
    layer_ids: tuple[int, ...]
    size: int
    shape: dict = field(hash=False)
    device: torch.device = _CPU
    accounting_only: bool = False
    what: str = "a pool"
    unit: str = "handles"
    flags: tuple[str, ...] = ()
    sidecars: tuple[SidecarPool, ...] = ()

    def __post_init__(self) -> None:
        handle_count(self.size, self.what, self.unit, self.flags)

    @property
    def bytes_per_handle(self) -> int:
        """As the pool's: its own rows plus its sidecars'."""
        return (self.pool_class.bytes_per_handle_for(len(self.layer_ids), **self.shape)
                + sum(sc.bytes_per_handle for sc in self.sidecars))

    @property
    def nbytes(self) -> int:
        """Tensor bytes from the shapes (also when accounting-only, like a pool's)."""
        return self.size * self.bytes_per_handle

    def bytes_on(self) -> dict[torch.device, int]:
        """What building it takes, per device: its tensors where it lives (none when
        accounting-only), its allocator's bookkeeping on the host."""
        need = {_CPU: self.size * HandleAllocator.BYTES_PER_HANDLE}
        if not self.accounting_only:
            where = _where(self.device)
            need[where] = need.get(where, 0) + self.nbytes
        return need

    def host_copy(self, size: int, flags: tuple[str, ...]) -> "PoolPlan":
        """The plan of its host-tier mirror (as ``host_mirror`` makes it) with ``size``
        handles, sized by ``flags``."""
        sidecars = tuple(SidecarPool(sc.name, sc.shape_per_handle, sc.dtype, "cpu") for sc in self.sidecars)
        return replace(self, size=size, device=_CPU, what=f"the host copy of {self.what}", flags=flags,
                       sidecars=sidecars)

    def build(self, **kw):
        """The pool itself, its sidecars registered (``kw``: the constructor's other
        keywords, e.g. pin_memory). Once: a sidecar belongs to one pool."""
        pool = self.pool_class(self.layer_ids, self.size, **self.shape, device=self.device,
                               name=self.name, accounting_only=self.accounting_only, **kw)
        for sc in self.sidecars:
            pool.register_sidecar(sc)
        return pool


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """Host memory the kernel could give without swapping: MemAvailable, else the
    free pages sysconf reports, else None (unknown)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def available_bytes(device) -> int | None:
    """Free memory on ``device``; None where it cannot be known (then nothing is checked:
    a CUDA device torch cannot see fails on its own, with torch's message)."""
    device = torch.device(device)
    if device.type == "cpu":
        return host_available_bytes()
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info(device)[0]
    return None


def check_fits(plans, *, usable: float = USABLE_FRACTION) -> None:
    """ValueError unless, on every device, the pools ``plans`` will build fit within
    ``usable`` of its available memory. The message gives each pool's share with the
    flags that size it, and says which flag to lower (the largest pool's)."""
    shares: dict[torch.device, list[tuple[int, PoolPlan]]] = {}
    for plan in plans:
        for where, nbytes in plan.bytes_on().items():
            if nbytes:
                shares.setdefault(where, []).append((nbytes, plan))
    for where, parts in shares.items():
        total = sum(n for n, _ in parts)
        available = available_bytes(where)
        if available is None or total <= usable * available:
            continue
        parts.sort(key=lambda part: -part[0])
        sized = [(_named(plan, where), f"{format_bytes(n)} for {plan.size} {plan.unit}{_sized_by(plan.flags)}")
                 for n, plan in parts]
        if len(parts) == 1 or parts[0][0] > usable * available:  # the largest alone is the culprit
            lead = "{} needs {}".format(*sized[0])
        else:
            lead = (f"the pools on the {where} need {format_bytes(total)} in all ("
                    + "; ".join(f"{name} {amount}" for name, amount in sized) + ")")
        raise ValueError(f"{lead} and the {where} has {format_bytes(available)} available (the pools "
                         f"may use {usable:.0%} of it): {_fix(parts[0][1].flags)}")


def format_bytes(n: int) -> str:
    """GB as --hicache-size means them (2**30 bytes), MB below 0.1 GB."""
    if n >= 2**30 / 10:
        return f"{n / 2**30:.1f} GB"
    if n >= 2**20 / 10:
        return f"{n / 2**20:.1f} MB"
    return f"{n} bytes"


def _named(plan: PoolPlan, where: torch.device) -> str:
    """A pool's name in a device's list: on the host, a device pool's share is its allocator's."""
    return plan.what if where == _where(plan.device) else f"{plan.what}'s handle bookkeeping"


def _where(device) -> torch.device:
    """One key per memory: a bare "cuda" is the current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device
