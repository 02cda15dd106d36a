"""Handle accounting and the tensors behind the handles.

The radix tree decides which handles (KV pages, MAMBA state slots) to keep;
this package owns the handles (``HandleAllocator``) and the storage they
index (``KVPool``, ``MambaStatePool``, plus ``SidecarPool`` extras), and the
host tier's mirrors of them (``host_mirror``, ``copy_handles``, ``host_sizes``),
and whether pools of given sizes fit before any is built (``PoolPlan``,
``check_fits``).
"""

from .allocator import DoubleFree, HandleAllocator, PoolExhausted, as_index_array
from .budget import PoolPlan, available_bytes, check_fits
from .host import copy_handles, host_mirror, host_sizes
from .kv import KVPool
from .mamba import MambaStatePool
from .pool import HandlePool
from .sidecar import SidecarPool

__all__ = [
    "DoubleFree",
    "HandleAllocator",
    "HandlePool",
    "KVPool",
    "MambaStatePool",
    "PoolExhausted",
    "PoolPlan",
    "SidecarPool",
    "as_index_array",
    "available_bytes",
    "check_fits",
    "copy_handles",
    "host_mirror",
    "host_sizes",
]
