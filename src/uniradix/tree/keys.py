"""Token keys as bytes: one conversion per request, then every comparison is a memcmp."""
from __future__ import annotations

from array import array

TOKEN_BYTES = 4  # uint32 per token: every real vocabulary fits


def encode(tokens) -> bytes:
    """Tokens (list, tuple, array, numpy array) to the byte key the tree compares."""
    if isinstance(tokens, array) and tokens.itemsize == TOKEN_BYTES and tokens.typecode in "IiLl":
        return tokens.tobytes()
    try:
        return array("I", tokens).tobytes()
    except OverflowError as e:
        raise ValueError(f"token ids must be in [0, 2**32): {e}") from None
    except TypeError as e:
        raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}: {e}") from None


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
