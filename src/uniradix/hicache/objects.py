"""The stored object: a small header, then the payload. The header names what the
bytes are (format version, namespace, key, length) and carries a checksum of the
payload, so an object written by another model, for another key, cut short or
corrupted is recognised and treated as a miss, never used."""
from __future__ import annotations

import hashlib
import struct

MAGIC = b"URXO"
VERSION = 1
# magic, version, key length, payload length, namespace digest (16), payload checksum (16)
_HEAD = struct.Struct("<4sHHQ16s16s")


class CorruptObject(ValueError):
    """An object that fails its header or checksum; `reason` says which check."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"stored object {key!r} is unusable: {reason}")
        self.key = key
        self.reason = reason


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def namespace_digest(seed: bytes) -> bytes:
    return _digest(b"ns" + seed)


def pack_object(key: str, payload: bytes, namespace: bytes) -> bytes:
    """Header + key + payload. `namespace` is StorageNamespace.seed()."""
    k = key.encode()
    return _HEAD.pack(MAGIC, VERSION, len(k), len(payload), namespace_digest(namespace),
                      _digest(payload)) + k + payload


def unpack_object(data: bytes | None, key: str, namespace: bytes) -> bytes:
    """The payload, after checking everything the header says; CorruptObject otherwise."""
    if data is None:
        raise CorruptObject(key, "absent")
    if len(data) < _HEAD.size:
        raise CorruptObject(key, f"truncated header ({len(data)} bytes)")
    magic, version, klen, plen, ns, check = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise CorruptObject(key, "not a uniradix object")
    if version != VERSION:
        raise CorruptObject(key, f"format version {version}, this build reads {VERSION}")
    if ns != namespace_digest(namespace):
        raise CorruptObject(key, "written under another namespace (model, page size, rank or salt)")
    k0 = _HEAD.size
    if data[k0:k0 + klen] != key.encode():
        raise CorruptObject(key, "stored under another key")
    p0 = k0 + klen
    if len(data) != p0 + plen:
        raise CorruptObject(key, f"length {len(data) - p0}, header says {plen}")
    payload = bytes(data[p0:])
    if _digest(payload) != check:
        raise CorruptObject(key, "checksum mismatch")
    return payload
