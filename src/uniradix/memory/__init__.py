"""Handle accounting and the tensors behind the handles.

The radix tree decides which handles (KV pages, MAMBA state slots) to keep;
this package owns the handles (``HandleAllocator``) and the storage they
index (``KVPool``, ``MambaStatePool``, plus ``SidecarPool`` extras).
"""

from .allocator import DoubleFree, HandleAllocator, PoolExhausted, as_index_array
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
]
