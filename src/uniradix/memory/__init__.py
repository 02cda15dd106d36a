"""Handle accounting and the tensors behind the handles.

The radix tree decides which handles (KV pages, MAMBA state slots) to keep;
this package owns the handles (``HandleAllocator``) and the storage they
index (``KVPool``, ``MambaStatePool``, plus ``SidecarPool`` extras), and the
host tier's mirrors of them (``host_mirror``, ``copy_handles``, ``host_sizes``).
"""

from .allocator import DoubleFree, HandleAllocator, PoolExhausted, as_index_array
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
    "SidecarPool",
    "as_index_array",
    "copy_handles",
    "host_mirror",
    "host_sizes",
]
