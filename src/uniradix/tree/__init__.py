"""Tree core: topology and bookkeeping over integer handles; standard library only."""
from .component import CheckpointComponent, Component, PageComponent
from .components import FullComponent, MambaComponent, SWAComponent
from .eviction import POLICIES
from .keys import decode, encode, salt_key
from .node import Node
from .evict import COPY_DOWN, DROP_COPY, LOSE, Eviction
from .results import EvictResult, Freed, InsertResult, LockReceipt, MatchResult
from .tree import LockError, RadixTree

__all__ = [
    "CheckpointComponent", "Component", "PageComponent", "FullComponent", "MambaComponent",
    "SWAComponent", "POLICIES", "decode", "encode", "salt_key", "Node", "EvictResult", "InsertResult",
    "LockReceipt", "MatchResult", "LockError", "RadixTree", "Freed", "Eviction", "COPY_DOWN", "DROP_COPY", "LOSE",
]
