"""L3 keys: a chained SHA-256 over each page's tokens, seeded by a namespace, so a key
names a page *and everything before it*, and two models, two checkpoints of one model,
two page sizes, two ranks or two tenants (salts) never share a key."""
from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass, replace

from ..tree.keys import salt_key
from .storage import check_key


@dataclass(frozen=True)
class StorageNamespace:
    """What must match for two engines to read each other's data: the model (layer
    pattern, dims, dtype: any text that changes when the KV would), the weights'
    fingerprint (two checkpoints of one architecture compute different KV), the page
    size, the tensor-parallel rank, the request's cache salt (by the tree's salt rule,
    so a tenant is the same tenant in every tier), and `binding`: what else decides
    whether a reader may use an object (hicache.l3.bound_namespace: the witness of the
    weights as loaded, a digest of the objects' MAC secret), so that a reader never
    even finds an object it could not use."""

    model: str
    page_size: int
    rank: int = 0
    salt: object = None
    weights: str = ""
    binding: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"the model must be a non-empty string, got {self.model!r:.60}")
        if self.page_size < 1:
            raise ValueError(f"page size must be at least 1, got {self.page_size}")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if not isinstance(self.weights, str):
            raise ValueError(f"the weights fingerprint must be a string, got {type(self.weights).__name__}")
        if not isinstance(self.binding, str):
            raise ValueError(f"the namespace's binding must be a string, got {type(self.binding).__name__}")
        salt_key(self.salt)  # a salt the tree would refuse is refused here too

    @classmethod
    def for_model(cls, cfg, page_size: int, rank: int = 0, weights: str = "",
                  salt=None) -> "StorageNamespace":
        """The namespace of a HybridConfig (every field: a changed window or dtype changes
        the stored bytes' meaning) and a weights fingerprint (see
        uniradix.model.fingerprint). `cfg` may instead be a string: the model's name as a
        fleet chooses it, used as it is."""
        if isinstance(cfg, str):
            return cls(cfg, page_size, rank, salt, weights)
        fields = cfg if isinstance(cfg, dict) else {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
        return cls(json.dumps(fields, sort_keys=True, default=repr), page_size, rank, salt, weights)

    def with_salt(self, salt) -> "StorageNamespace":
        """This namespace for a request's salt (everything else kept, the weights too)."""
        return replace(self, salt=salt)

    def seed(self) -> bytes:
        """The chain's starting digest."""
        fields = [self.model, self.weights, self.page_size, self.rank, salt_key(self.salt)]
        if self.binding:   # (without one, the seeds of stores written before it stay)
            fields.append(self.binding)
        text = json.dumps(fields)
        return hashlib.sha256(b"uniradix-ns-v2\0" + text.encode()).digest()


def page_keys(tokens, ns: StorageNamespace, start_digest: bytes | None = None) -> list[str]:
    """One key per whole page of `tokens`: key_i = SHA-256(key_{i-1} || page_i's tokens as
    little-endian int32), key_{-1} = the namespace seed (or `start_digest` to continue a
    chain). A trailing partial page gets no key."""
    P = ns.page_size
    prev = ns.seed() if start_digest is None else start_digest
    data = array("i", tokens)
    if data.itemsize != 4:  # pragma: no cover - every platform CPython supports has 4-byte int
        raise RuntimeError("int32 arrays are required")
    raw = data.tobytes() if _LITTLE else _swapped(data)
    out = []
    step = 4 * P
    for off in range(0, len(raw) - len(raw) % step, step):
        prev = hashlib.sha256(prev + raw[off:off + step]).digest()
        out.append(prev.hex())
    return out


def component_key(page_key: str, suffix: str) -> str:
    """The key of a component's object at a page ("swa", "mamba") or a sidecar pool's
    ("kv.scales", say, written with '_' for '.'): the page key plus a suffix."""
    key = f"{check_key(page_key)}.{suffix}"
    return check_key(key)


def witness_key(ns: StorageNamespace, secret: bytes | None = None) -> str:
    """Where a namespace keeps the witness of its weights (hicache.witness): derived from
    the namespace without its salt (one witness for every tenant of a model) and, when
    objects are MAC'd, from a digest of the secret, so that engines with different
    secrets (who cannot read each other's objects anyway) never contend for one key."""
    # v2: witnesses of model.fingerprint.model_witness's form (v1 held the sampled
    # weights alone); engines of either form never meet under one key
    h = hashlib.sha256(b"uniradix-witness-key-v2\0" + replace(ns, salt=None, binding="").seed())
    if secret:
        h.update(hashlib.blake2b(secret, digest_size=16, person=b"urx-l3-witness").digest())
    return check_key(f"{h.hexdigest()}.witness")


_LITTLE = array("i", [1]).tobytes()[0] == 1


def _swapped(a: array) -> bytes:
    b = array("i", a)
    b.byteswap()
    return b.tobytes()
