"""L3 keys name a page and everything before it, within one namespace; stored objects
are recognised as bad, never used, whatever way they are wrong."""
import hashlib
from array import array

import pytest

from uniradix.hicache import CorruptObject, StorageNamespace, component_key, pack_object, page_keys, unpack_object
from uniradix.model import preset

NS = StorageNamespace("model-a", page_size=4)


def test_keys_chain_over_whole_pages():
    toks = list(range(10))
    keys = page_keys(toks, NS)
    assert len(keys) == 2  # the partial third page has no key
    h0 = hashlib.sha256(NS.seed() + array("i", range(4)).tobytes()).digest()
    h1 = hashlib.sha256(h0 + array("i", range(4, 8)).tobytes()).digest()
    assert keys == [h0.hex(), h1.hex()]
    # continuing a chain from a digest gives the same keys
    assert page_keys(toks[4:], NS, start_digest=h0) == keys[1:]


def test_a_key_depends_on_everything_before_it():
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8], NS)
    b = page_keys([9, 2, 3, 4, 5, 6, 7, 8], NS)
    assert a[1] != b[1]  # same second page, different first page
    assert page_keys([1, 2, 3, 4, 5, 6, 7, 8, 0], NS) == a


@pytest.mark.parametrize("other", [
    StorageNamespace("model-b", 4), StorageNamespace("model-a", 4, rank=1),
    StorageNamespace("model-a", 4, salt="tenant-2"), StorageNamespace("model-a", 2),
])
def test_namespaces_never_share_keys(other):
    toks = list(range(16))
    assert not set(page_keys(toks, NS)) & set(page_keys(toks, other))


def test_model_fingerprint_covers_every_config_field():
    cfg = preset("tiny-hybrid")
    base = StorageNamespace.for_model(cfg, 4)
    assert base == StorageNamespace.for_model(preset("tiny-hybrid"), 4)
    for change in (dict(window=8), dict(dtype="bfloat16"), dict(pattern="FSMS"), dict(seed=1)):
        assert StorageNamespace.for_model(cfg.with_(**change), 4).seed() != base.seed(), change


def test_component_keys():
    k = page_keys([1, 2, 3, 4], NS)[0]
    assert component_key(k, "swa") == k + ".swa"
    assert component_key(k, "mamba") != component_key(k, "swa")
    with pytest.raises(ValueError):
        component_key(k, "bad/suffix")
    with pytest.raises(ValueError):
        component_key("not-a-key", "swa")


def test_bad_namespace_settings():
    with pytest.raises(ValueError):
        StorageNamespace("m", 0)
    with pytest.raises(ValueError):
        StorageNamespace("m", 4, rank=-1)


KEY = "ab" * 32


def test_object_round_trip():
    for payload in (b"", b"x", bytes(range(256)) * 1000):
        assert unpack_object(pack_object(KEY, payload, NS.seed()), KEY, NS.seed()) == payload


def _bad(data, key=KEY, ns=NS.seed()):
    with pytest.raises(CorruptObject) as e:
        unpack_object(data, key, ns)
    return e.value.reason


def test_every_kind_of_bad_object_is_refused():
    good = pack_object(KEY, b"payload-bytes" * 10, NS.seed())
    assert "absent" in _bad(None)
    assert "truncated header" in _bad(good[:10])
    assert "length" in _bad(good[:-1])                      # truncated payload
    assert "length" in _bad(good + b"\0")                   # trailing junk
    assert "not a uniradix" in _bad(b"XXXX" + good[4:])
    flipped = bytearray(good)
    flipped[-3] ^= 1
    assert "checksum" in _bad(bytes(flipped))
    assert "another key" in _bad(good, key="cd" * 32)
    assert "namespace" in _bad(good, ns=StorageNamespace("model-b", 4).seed())
    version = bytearray(good)
    version[4] = 9
    assert "version" in _bad(bytes(version))
