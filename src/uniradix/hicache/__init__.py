"""HiCache: the tiers below the device pools. L3 so far: page keys, the stored
object format, the `StorageBackend` interface and its backends."""
from .keys import StorageNamespace, component_key, page_keys
from .objects import CorruptObject, pack_object, unpack_object
from .storage import StorageBackend, StorageUnavailable, check_key

__all__ = ["StorageNamespace", "component_key", "page_keys", "CorruptObject", "pack_object",
           "unpack_object", "StorageBackend", "StorageUnavailable", "check_key"]
