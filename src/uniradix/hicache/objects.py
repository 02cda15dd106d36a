"""The stored object: a small header, then the key and the payload. The header names
what the bytes are (format version, namespace, key, length) and carries a check over
all of it, so an object written by another model, for another key, cut short or
corrupted is recognised and treated as a miss, never used.

Without a secret the check is a plain checksum: it catches accidents, not a writer
who means harm (anyone can recompute it). With a secret it is a MAC keyed by the
secret, and a reader with a secret accepts only objects keyed with that same secret:
whoever can write to the store but lacks the secret cannot make a reader use data.

The header also names the instance that wrote the object (16 bytes: the writing
storage tier's id, zeros when unknown), under the check like the rest, so that a reader
can tell a hit on what another server computed from a hit on its own (the fleet's
cross-instance reuse).

Format 3 (written now): magic, version 3, flags (bit 0: keyed), key length, payload
length, namespace digest (16), writer (16), check (32) = BLAKE2b-256 over the header
before the check, the key and the payload; keyed with a key derived from the secret
when flag 0 is set. Format 2 (read only): format 3 without the writer. Format 1 (read
only, unkeyed): magic, version 1, key length, payload length, namespace digest,
BLAKE2b-128 of the payload."""
from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct

from ..config import L3_SECRET_ENV as SECRET_ENV

MAGIC = b"URXO"
VERSION = 3
KEYED = 1  # flags bit: the check is a MAC keyed by a secret
#: the highest format taken for a newer build's (above it, a damaged version field)
NEWEST_PLAUSIBLE = 15
#: the writer of an object whose writer is not known (format 2 and 1, or not given)
NO_WRITER = bytes(16)
# magic, version, flags, key length, payload length, namespace digest (16), writer (16), check (32)
_HEAD = struct.Struct("<4sHHHQ16s16s32s")
_CHECKED = _HEAD.size - 32  # the header bytes the check covers
# format 2: format 3 without the writer
_HEAD_V2 = struct.Struct("<4sHHHQ16s32s")
# format 1: magic, version, key length, payload length, namespace digest (16), payload checksum (16)
_HEAD_V1 = struct.Struct("<4sHHQ16s16s")

ABSENT, CORRUPT, UNAUTHENTICATED, NEWER = "absent", "corrupt", "unauthenticated", "newer"


class CorruptObject(ValueError):
    """An object that cannot be used. `reason` says which check failed; `kind` sorts
    them: "absent" (no object), "corrupt" (malformed, another namespace or key, a bad
    checksum), "unauthenticated" (not keyed by this reader's secret: forged, or
    written by an engine configured with another secret or none) or "newer" (a format
    this build does not read: a newer server's, in a fleet being upgraded; a miss,
    never deleted)."""

    def __init__(self, key: str, reason: str, kind: str = CORRUPT) -> None:
        super().__init__(f"stored object {key!r} is unusable: {reason}")
        self.key = key
        self.reason = reason
        self.kind = kind


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def namespace_digest(seed: bytes) -> bytes:
    return _digest(b"ns" + seed)


@functools.lru_cache(maxsize=8)
def _mac_key(secret: bytes) -> bytes:
    """32 bytes from a secret of any length (BLAKE2b takes keys of at most 64)."""
    return hashlib.blake2b(secret, digest_size=32, person=b"urx-l3-secret").digest()


def _check_secret(secret) -> bytes | None:
    if secret is None:
        return None
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise TypeError(f"the L3 secret must be bytes (see resolve_secret), got {type(secret).__name__}")
    secret = bytes(secret)
    if not secret:
        raise ValueError("the L3 secret must not be empty")
    return secret


def _check(head: bytes, key: bytes, payload, secret: bytes | None) -> bytes:
    h = (hashlib.blake2b(digest_size=32, key=_mac_key(secret), person=b"urx-l3-mac") if secret
         else hashlib.blake2b(digest_size=32, person=b"urx-l3-sum"))
    h.update(head)
    h.update(key)
    h.update(payload)
    return h.digest()


#: the longest key (storage.KEY_RE: 64 hex digits, a dot, a 32-character suffix)
_MAX_KEY = 64 + 1 + 32


def object_nbytes_at_most(payload_nbytes: int) -> int:
    """The largest stored object with a payload of `payload_nbytes` (any key, any format):
    a reader's bound on what it reads (StorageBackend.expect_values_up_to)."""
    return max(_HEAD.size, _HEAD_V2.size, _HEAD_V1.size) + _MAX_KEY + payload_nbytes


def pack_object(key: str, payload: bytes, namespace: bytes, secret: bytes | None = None,
                writer: bytes = NO_WRITER) -> bytes:
    """Header + key + payload. `namespace` is StorageNamespace.seed(); `secret` (bytes,
    see resolve_secret) makes the check a MAC only holders of the secret can write;
    `writer`: the writing instance's 16-byte id."""
    secret = _check_secret(secret)
    if not isinstance(writer, bytes) or len(writer) != 16:
        raise ValueError(f"a writer id is 16 bytes, got {writer!r:.40}")
    k = key.encode()
    head = _HEAD.pack(MAGIC, VERSION, KEYED if secret else 0, len(k), len(payload),
                      namespace_digest(namespace), writer, bytes(32))[:_CHECKED]
    return head + _check(head, k, payload, secret) + k + payload


def unpack_object(data: bytes | None, key: str, namespace: bytes, secret: bytes | None = None) -> bytes:
    """The payload, after checking everything the header says; CorruptObject otherwise.
    With `secret`, only objects keyed with it are accepted; without one, a keyed object
    is refused too (this reader cannot tell it from a forgery)."""
    return unpack_with_writer(data, key, namespace, secret)[0]


def unpack_with_writer(data: bytes | None, key: str, namespace: bytes,
                       secret: bytes | None = None) -> tuple[bytes, bytes | None]:
    """unpack_object's payload and the id of the instance that wrote it (None where the
    object does not say: format 1 and 2, or written without one)."""
    secret = _check_secret(secret)
    if data is None:
        raise CorruptObject(key, ABSENT, ABSENT)
    if len(data) < 6:
        raise CorruptObject(key, f"truncated header ({len(data)} bytes)")
    magic, version = struct.unpack_from("<4sH", data)
    if magic != MAGIC:
        raise CorruptObject(key, "not a uniradix object")
    if version == 1:
        return _unpack_v1(data, key, namespace, secret), None
    if VERSION < version <= NEWEST_PLAUSIBLE:
        raise CorruptObject(key, f"format version {version}, newer than this build reads (1 to {VERSION})", NEWER)
    if version not in (2, VERSION):
        raise CorruptObject(key, f"format version {version}, this build reads 1 to {VERSION}")
    head = _HEAD if version == VERSION else _HEAD_V2
    if len(data) < head.size:
        raise CorruptObject(key, f"truncated header ({len(data)} bytes)")
    if version == VERSION:
        _, _, flags, klen, plen, ns, writer, check = head.unpack_from(data)
    else:
        (_, _, flags, klen, plen, ns, check), writer = head.unpack_from(data), NO_WRITER
    if flags & ~KEYED:
        raise CorruptObject(key, f"unknown flags {flags:#x}")
    if secret and not flags & KEYED:
        raise CorruptObject(key, "not keyed by a secret, and this reader requires one", UNAUTHENTICATED)
    if flags & KEYED and not secret:
        raise CorruptObject(key, "keyed by a secret this reader does not have", UNAUTHENTICATED)
    payload = _body(data, key, namespace, ns, head.size, klen, plen)
    k = key.encode()
    if not hmac.compare_digest(_check(data[:head.size - 32], k, payload, secret), check):
        if secret:
            raise CorruptObject(key, "MAC mismatch (forged, corrupted, or keyed with another secret)",
                                UNAUTHENTICATED)
        raise CorruptObject(key, "checksum mismatch")
    return payload, (None if writer == NO_WRITER else writer)


def _unpack_v1(data, key: str, namespace: bytes, secret: bytes | None) -> bytes:
    """Format 1: unkeyed, so never good enough for a reader with a secret."""
    if secret:
        raise CorruptObject(key, "format 1 object, not keyed by a secret, and this reader requires one",
                            UNAUTHENTICATED)
    if len(data) < _HEAD_V1.size:
        raise CorruptObject(key, f"truncated header ({len(data)} bytes)")
    _, _, klen, plen, ns, check = _HEAD_V1.unpack_from(data)
    payload = _body(data, key, namespace, ns, _HEAD_V1.size, klen, plen)
    if not hmac.compare_digest(_digest(payload), check):
        raise CorruptObject(key, "checksum mismatch")
    return payload


def _body(data, key: str, namespace: bytes, ns: bytes, k0: int, klen: int, plen: int) -> bytes:
    """The payload, once the namespace, key and length agree with the header."""
    if ns != namespace_digest(namespace):
        raise CorruptObject(key, "written under another namespace (model, weights, page size, rank or salt)")
    if data[k0:k0 + klen] != key.encode():
        raise CorruptObject(key, "stored under another key")
    p0 = k0 + klen
    if len(data) != p0 + plen:
        raise CorruptObject(key, f"length {len(data) - p0}, header says {plen}")
    return bytes(data[p0:])


def resolve_secret(value=None) -> bytes | None:
    """The L3 secret as bytes: `value` (the "auth_secret" setting) when given, else the
    environment variable UNIRADIX_L3_SECRET, else None (unkeyed objects). A value that
    is set but is not a non-empty string is a ValueError naming the setting, never
    showing the value: a secret that was meant but is empty must not silently turn
    authentication off."""
    where = "auth_secret"
    if value is None:
        value = os.environ.get(SECRET_ENV)
        where = f"the environment variable {SECRET_ENV}"
        if value is None:
            return None
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a non-empty string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{where} is set but empty; unset it to run without a secret")
    return value.encode("utf-8")
