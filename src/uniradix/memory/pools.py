"""All pool classes in one import (they live in one module per job)."""

from .kv import KVPool
from .mamba import MambaStatePool
from .pool import HandlePool
from .sidecar import SidecarPool

__all__ = ["HandlePool", "KVPool", "MambaStatePool", "SidecarPool"]
