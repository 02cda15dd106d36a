"""Token keys as bytes: one conversion per request, then every comparison is a memcmp."""
from __future__ import annotations

from array import array

TOKEN_BYTES = 4  # uint32 per token: every real vocabulary fits


def encode(tokens) -> bytes:
    """Tokens (list, tuple, array, numpy array) to the byte key the tree compares."""
    if isinstance(tokens, array) and tokens.itemsize == TOKEN_BYTES and tokens.typecode in "IiLl":
        return tokens.tobytes()
    try:
        if type(tokens) is list:  # the common input: fromlist converts twice as fast as array(list)
            out = array("I")
            out.fromlist(tokens)
            return out.tobytes()
        return array("I", tokens).tobytes()
    except OverflowError as e:
        raise ValueError(f"token ids must be in [0, 2**32): {e}") from None
    except TypeError as e:
        raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}: {e}") from None


def salt_key(salt) -> str | None:
    """The one rule for cache salts, used by the tree's roots and by L3's namespace: a
    salt is None (shared), a str, bytes or an int (not a bool), and two salts are the
    same tenant iff their types and values are equal ("1", 1 and b"1" are three
    tenants). Returns the canonical text both tiers key by; anything else (floats,
    bools, unhashable or arbitrary objects, whose equality and repr are not stable
    names) is a ValueError."""
    if salt is None:
        return None
    t = type(salt)
    if t is str:
        return "s:" + salt
    if t is int:
        return "i:" + str(salt)
    if t is bytes:
        return "b:" + salt.hex()
    raise ValueError(f"a cache salt must be None, a str, bytes or an int (not a bool or a float), "
                     f"got {t.__name__} {salt!r:.40}")


def check_session_id(session_id) -> None:
    """A session id names a conversation across turns: None, a str, or an int (not a bool)."""
    if session_id is not None and type(session_id) not in (str, int):
        raise ValueError(f"session_id must be None, a str or an int, got {type(session_id).__name__} "
                         f"{session_id!r:.40}")


def session_key(session_id, salt=None) -> tuple:
    """The one rule for who a session belongs to: the tenant (the request's cache salt,
    as `salt_key` partitions reuse) it was opened under, with its id. The same id under
    another salt is another session, so from another tenant a session does not exist:
    the tree's references, the server's open sessions and their turns all key by this."""
    check_session_id(session_id)
    return salt_key(salt), session_id


def check_priority(priority) -> None:
    """Eviction priority: None or a Python int (it is compared with other nodes' priorities
    and ordered in the eviction heaps)."""
    if priority is None or type(priority) is int and -2 ** 63 <= priority < 2 ** 63:
        return
    raise ValueError(f"priority must be None or an int in [-2**63, 2**63), got "
                     f"{type(priority).__name__} {priority!r:.40}")


def decode(key: bytes) -> list[int]:
    """Back to token ids (for debugging and tests)."""
    out = array("I")
    out.frombytes(key)
    return out.tolist()


def common_prefix(key: bytes, off: int, node_key: bytes, unit: int) -> int:
    """Bytes of node_key that key[off:] matches, rounded down to whole pages of `unit` bytes."""
    if key.startswith(node_key, off):
        return len(node_key)
    lo, hi = 0, min(len(node_key), len(key) - off) // unit
    while lo < hi:  # lo pages are known to match, hi+1 are known not to
        mid = (lo + hi + 1) >> 1
        if key.startswith(node_key[: mid * unit], off):
            lo = mid
        else:
            hi = mid - 1
    return lo * unit
