"""One salt rule for every tier (tree.keys.salt_key): a salt is None, a str, bytes or an
int; two salts are one tenant iff their types and values are equal. The device tree
and L3 used to disagree (1, True and 1.0 are equal in Python, so they shared one device
root, while L3 keyed them apart by repr)."""
from __future__ import annotations

import random

import pytest
from engine_checks import check_exact, greedy, toks

from uniradix.hicache.backends.file import FileBackend
from uniradix.tree import FullComponent, RadixTree, salt_key


def test_the_rule():
    assert salt_key(None) is None
    keys = [salt_key(s) for s in (1, "1", b"1", "i:1", 2)]
    assert len(set(keys)) == len(keys)
    for bad in (True, 1.0, (1,), ["a"], object()):
        with pytest.raises(ValueError, match="salt"):
            salt_key(bad)
    tree = RadixTree([FullComponent()])
    for bad in (True, 1.0):
        with pytest.raises(ValueError, match="salt"):
            tree.match([1, 2, 3], salt=bad)


@pytest.mark.parametrize("tier", ["device", "storage"])
def test_salts_equal_in_python_are_separate_tenants_in_every_tier(make_engine, tmp_path, tier):
    rng = random.Random(5)
    prompt = toks(rng, 32)
    store = (lambda: FileBackend(str(tmp_path))) if tier == "storage" else (lambda: None)
    kw = dict(page_size=4, max_total_tokens=1024, storage=store())
    if tier == "storage":   # a store's setting (an engine without one refuses it)
        kw["prefetch_threshold"] = 1
    eng = make_engine("tiny-hybrid", **kw)
    first = greedy(prompt, 3)
    first.salt = 1
    eng.run([first])
    if tier == "storage":  # every later request on a fresh engine: only L3 can serve it
        eng.close()
    for salt, shares in ((1, True), ("1", False), (b"1", False), (None, False)):
        e = make_engine("tiny-hybrid", **{**kw, "storage": store()}) if tier == "storage" else eng
        r = greedy(prompt + [7, 7, 7, 7, 7], 2)
        r.salt = salt
        e.run([r])
        check_exact(e, r)
        assert (r.metrics.cached_tokens > 0) == shares, (salt, r.metrics)
        if tier == "storage":
            assert r.metrics.storage_tokens == r.metrics.cached_tokens
            e.close()
    for bad in (True, 1.0):
        r = greedy(prompt, 2)
        r.salt = bad
        with pytest.raises(ValueError, match="salt"):
            eng.submit(r)
