"""L3 keys name a page and everything before it, within one namespace; stored objects
are recognised as bad, never used, whatever way they are wrong."""
import hashlib
import struct
from array import array

import pytest

from uniradix.hicache import CorruptObject, StorageNamespace, component_key, pack_object, page_keys, unpack_object
from uniradix.hicache import objects
from uniradix.hicache.objects import resolve_secret
from uniradix.model import preset
from uniradix.tree import salt_key

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


def test_the_weights_fingerprint_separates_checkpoints():
    cfg, toks = preset("tiny-hybrid"), list(range(16))
    a = StorageNamespace.for_model(cfg, 4, weights="fp-a")
    b = StorageNamespace.for_model(cfg, 4, weights="fp-b")
    assert not set(page_keys(toks, a)) & set(page_keys(toks, b))
    assert page_keys(toks, a) == page_keys(toks, StorageNamespace.for_model(preset("tiny-hybrid"), 4, weights="fp-a"))
    assert a.seed() != StorageNamespace.for_model(cfg, 4).seed()  # no fingerprint is one more namespace
    # a request's salt keeps the fingerprint (and everything else)
    assert a.with_salt("t") == StorageNamespace.for_model(cfg, 4, weights="fp-a", salt="t")
    assert a.with_salt("t").weights == "fp-a" and a.with_salt(None) == a
    with pytest.raises(ValueError, match="weights"):
        StorageNamespace("m", 4, weights=b"fp")


def test_a_fleet_may_name_its_model_itself():
    cfg = preset("tiny-hybrid")
    named = StorageNamespace.for_model("acme/hybrid-7b@2024-06", 4, rank=1, weights="fp", salt="t")
    assert named == StorageNamespace("acme/hybrid-7b@2024-06", 4, 1, "t", "fp")
    assert named.seed() != StorageNamespace.for_model(cfg, 4, 1, weights="fp", salt="t").seed()
    with pytest.raises(ValueError, match="model"):
        StorageNamespace("", 4)


def test_salts_follow_the_trees_rule():
    """1, "1" and b"1" are three tenants in L3 as in the tree; what the tree refuses,
    the namespace refuses."""
    toks = list(range(16))
    tenants = [StorageNamespace("m", 4, salt=s) for s in (None, 1, "1", b"1", "s:1", 2)]
    keys = [set(page_keys(toks, ns)) for ns in tenants]
    for i in range(len(keys)):
        for j in range(i):
            assert not keys[i] & keys[j], (tenants[i].salt, tenants[j].salt)
    assert page_keys(toks, StorageNamespace("m", 4, salt="1")) == page_keys(toks, tenants[2])
    for bad in (1.0, True, ("a",), object()):
        with pytest.raises(ValueError, match="cache salt") as e:
            StorageNamespace("m", 4, salt=bad)
        with pytest.raises(ValueError) as tree_e:
            salt_key(bad)
        assert str(e.value) == str(tree_e.value)
        with pytest.raises(ValueError):
            StorageNamespace("m", 4).with_salt(bad)


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


def _bad(data, key=KEY, ns=NS.seed(), secret=None, kind="corrupt"):
    with pytest.raises(CorruptObject) as e:
        unpack_object(data, key, ns, secret)
    assert e.value.kind == kind, e.value.reason
    return e.value.reason


def test_every_kind_of_bad_object_is_refused():
    good = pack_object(KEY, b"payload-bytes" * 10, NS.seed())
    assert _bad(None, kind="absent") == "absent"
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
    version[4] = 0
    assert "version" in _bad(bytes(version))                # no format 0
    version[4] = 9
    assert "newer" in _bad(bytes(version), kind="newer")    # a newer build's: not corrupt


def _v1(key, payload, seed):
    """An object as format 1 wrote it (unkeyed)."""
    k = key.encode()
    return struct.pack("<4sHHQ16s16s", b"URXO", 1, len(k), len(payload), objects.namespace_digest(seed),
                       hashlib.blake2b(payload, digest_size=16).digest()) + k + payload


def test_format_1_objects_stay_readable_without_a_secret():
    old = _v1(KEY, b"old payload", NS.seed())
    assert unpack_object(old, KEY, NS.seed()) == b"old payload"
    flipped = bytearray(old)
    flipped[-1] ^= 1
    assert "checksum" in _bad(bytes(flipped))
    assert "namespace" in _bad(old, ns=StorageNamespace("model-b", 4).seed())
    assert "truncated" in _bad(old[:20])
    assert "not keyed" in _bad(old, secret=b"s", kind="unauthenticated")


def _v2(key, payload, seed, secret=None):
    """An object as format 2 wrote it (no writer)."""
    k = key.encode()
    head = objects._HEAD_V2.pack(b"URXO", 2, objects.KEYED if secret else 0, len(k), len(payload),
                                 objects.namespace_digest(seed), bytes(32))[:objects._HEAD_V2.size - 32]
    return head + objects._check(head, k, payload, secret) + k + payload


def test_the_writer_travels_under_the_check_and_format_2_stays_readable():
    me = bytes(range(16))
    for secret in (None, b"s3"):
        obj = pack_object(KEY, b"page", NS.seed(), secret, writer=me)
        assert objects.unpack_with_writer(obj, KEY, NS.seed(), secret) == (b"page", me)
        assert objects.unpack_with_writer(pack_object(KEY, b"page", NS.seed(), secret), KEY, NS.seed(),
                                          secret) == (b"page", None)        # no writer given: unknown
        old = _v2(KEY, b"old page", NS.seed(), secret)
        assert objects.unpack_with_writer(old, KEY, NS.seed(), secret) == (b"old page", None)
        # another writer's id in place of this one's breaks the check (keyed: the MAC)
        i = objects._CHECKED - 16
        forged = obj[:i] + bytes(16 - 1) + b"\x01" + obj[objects._CHECKED:]
        with pytest.raises(CorruptObject):
            unpack_object(forged, KEY, NS.seed(), secret)
    with pytest.raises(ValueError):
        pack_object(KEY, b"page", NS.seed(), writer=b"short")


SECRET = b"correct horse battery staple"
PAYLOAD = b"the real page bytes" * 10
EVIL = b"attacker's page bytes" * 10


def test_keyed_round_trip():
    for secret in (b"x", SECRET, bytes(range(256)) * 4):  # any length
        for payload in (b"", PAYLOAD):
            obj = pack_object(KEY, payload, NS.seed(), secret)
            assert unpack_object(obj, KEY, NS.seed(), secret) == payload


def _flags_cleared(obj: bytes) -> bytes:
    b = bytearray(obj)
    b[6] = 0  # the flags field, after magic and version
    return bytes(b)


def _recomputed(obj: bytes, payload: bytes, key=KEY) -> bytes:
    """`obj` with its payload replaced and the check recomputed as anyone can: unkeyed."""
    magic, version, flags, klen, _, ns, writer, _ = objects._HEAD.unpack_from(obj)
    head = objects._HEAD.pack(magic, version, flags, klen, len(payload), ns, writer, bytes(32))[:objects._CHECKED]
    return head + objects._check(head, key.encode(), payload, None) + key.encode() + payload


def test_a_reader_with_a_secret_uses_nothing_it_did_not_key():
    good = pack_object(KEY, PAYLOAD, NS.seed(), SECRET)
    forged = {
        "unkeyed, fresh checksum": pack_object(KEY, EVIL, NS.seed()),
        "format 1, fresh checksum": _v1(KEY, EVIL, NS.seed()),
        "keyed with another secret": pack_object(KEY, EVIL, NS.seed(), b"guessed"),
        "flag cleared": _flags_cleared(good),
        "flag cleared, checksum recomputed": _flags_cleared(_recomputed(good, PAYLOAD)),
        "payload replaced, checksum recomputed": _recomputed(good, EVIL),
    }
    for how, obj in forged.items():
        reason = _bad(obj, secret=SECRET, kind="unauthenticated")
        assert reason, how
    flipped = bytearray(good)
    flipped[-1] ^= 1
    assert "MAC" in _bad(bytes(flipped), secret=SECRET, kind="unauthenticated")
    # the header's other checks still hold, keyed or not
    assert "namespace" in _bad(good, ns=StorageNamespace("model-b", 4).seed(), secret=SECRET)
    assert "another key" in _bad(good, key="cd" * 32, secret=SECRET)


def test_a_reader_without_the_secret_refuses_keyed_objects():
    good = pack_object(KEY, PAYLOAD, NS.seed(), SECRET)
    assert "does not have" in _bad(good, kind="unauthenticated")
    # clearing the flag does not make it an unkeyed object that checks out
    assert "checksum" in _bad(_flags_cleared(good))
    unknown = bytearray(good)
    unknown[6] = 2
    assert "flags" in _bad(bytes(unknown), secret=SECRET)


def test_unkeyed_objects_cover_their_header():
    good = pack_object(KEY, PAYLOAD, NS.seed())
    assert unpack_object(good, KEY, NS.seed()) == PAYLOAD
    for pos in range(6, objects._CHECKED):  # version kept, any other header byte flipped
        b = bytearray(good)
        b[pos] ^= 1
        with pytest.raises(CorruptObject) as e:
            unpack_object(bytes(b), KEY, NS.seed())
        assert e.value.kind in ("corrupt", "unauthenticated"), pos


def test_secrets_must_be_non_empty_bytes():
    with pytest.raises(ValueError):
        pack_object(KEY, PAYLOAD, NS.seed(), b"")
    with pytest.raises(TypeError):
        pack_object(KEY, PAYLOAD, NS.seed(), "a str")
    with pytest.raises(ValueError):
        unpack_object(pack_object(KEY, PAYLOAD, NS.seed()), KEY, NS.seed(), b"")


def test_resolve_secret(monkeypatch):
    monkeypatch.delenv("UNIRADIX_L3_SECRET", raising=False)
    assert resolve_secret() is None
    assert resolve_secret("s3cr\u00e9t") == "s3cr\u00e9t".encode()
    monkeypatch.setenv("UNIRADIX_L3_SECRET", "from-env")
    assert resolve_secret() == b"from-env"
    assert resolve_secret("given") == b"given"  # the setting wins over the environment
    for bad in ("", b"topsecret-bytes", 12345):
        with pytest.raises(ValueError, match="auth_secret") as e:
            resolve_secret(bad)
        assert "topsecret" not in str(e.value) and "12345" not in str(e.value)
    monkeypatch.setenv("UNIRADIX_L3_SECRET", "")
    with pytest.raises(ValueError, match="UNIRADIX_L3_SECRET"):
        resolve_secret()


def test_a_newer_format_is_a_miss_of_its_own_kind():
    """An object a newer build wrote (a fleet being upgraded) is told apart from a
    corrupt one: readers treat it as a miss and leave it where it is."""
    obj = bytearray(pack_object(KEY, b"page", NS.seed()))
    obj[4:6] = struct.pack("<H", objects.VERSION + 1)
    with pytest.raises(CorruptObject) as e:
        unpack_object(bytes(obj), KEY, NS.seed())
    assert e.value.kind == "newer" and "newer" in e.value.reason
