"""Every setting given to an Engine takes effect or is refused, as on the command line:
`hicache_storage_backend` builds the backend the CLI would (through the same builder,
its store reached at start), the tier's keys in the extra config are in force, and a
setting whose tier or policy is off is a ValueError naming it, never silently ignored."""
from __future__ import annotations

import json
import random

import pytest

from uniradix.engine import Engine, Request, SamplingParams
from uniradix.hicache.backends.file import FileBackend
from uniradix.hicache.storage import StorageUnavailable


def greedy(ids, n=2):
    return Request(input_ids=list(ids), sampling=SamplingParams(max_new_tokens=n, temperature=0))


def test_an_engine_builds_the_l3_its_settings_name_and_uses_it(tmp_path):
    """Before: Engine(hicache_storage_backend="file", ...) was accepted and built no L3."""
    settings = dict(page_size=4, hicache_storage_backend="file",
                    hicache_storage_backend_extra_config=json.dumps({"path": str(tmp_path), "prefetch_threshold": 4}))
    ids = [random.Random(1).randrange(3, 250) for _ in range(60)]
    first = Engine("tiny-hybrid", **settings)
    assert first.storage is not None and first.storage.threshold == 4   # the extra config's tier key is in force
    a = first.run([greedy(ids)])[0]
    first.close()
    assert any(tmp_path.iterdir())   # its objects are in the directory the settings name
    second = Engine("tiny-hybrid", **settings)   # another engine over the same store: it reads them
    b = second.run([greedy(ids)])[0]
    second.close()
    assert b.output_ids == a.output_ids
    assert second.stats()["storage_tokens"] > 0 and b.metrics.cached_tokens > 0


def test_an_engine_refuses_a_store_it_cannot_reach():
    extra = json.dumps({"url": "redis://:pw9@127.0.0.1:9/0", "socket_timeout": 1})
    pytest.importorskip("redis")
    with pytest.raises(StorageUnavailable, match=r"redis://:\*\*\*@127.0.0.1:9/0") as e:
        Engine("tiny-hybrid", hicache_storage_backend="redis", hicache_storage_backend_extra_config=extra)
    assert "pw9" not in str(e.value)
    eng = Engine("tiny-hybrid", hicache_storage_backend="redis",   # unless it may come later: counted
                 hicache_storage_backend_extra_config=json.dumps({**json.loads(extra), "prefetch_threshold": 1,
                                                                 "allow_unavailable_at_start": True}))
    eng.run([greedy(range(3, 40))])
    assert eng.stats()["storage_errors"] > 0
    eng.close()


NOT_IN_EFFECT = [
    (dict(prefetch_threshold=64), "prefetch_threshold.*no effect without an L3 store"),
    (dict(io_timeout=5.0), "io_timeout.*no effect without an L3 store"),
    (dict(hicache_storage_prefetch_policy="wait_complete"), "--hicache-storage-prefetch-policy.*L3 store"),
    (dict(hicache_storage_backend_extra_config='{"path": "/tmp/x"}'), "--hicache-storage-backend-extra-config"),
    (dict(rank=1), "rank.*L3 store"),
    (dict(hicache_ratio=4.0), "--hicache-ratio.*without the host tier"),
    (dict(hicache_size=0.01), "--hicache-size.*without the host tier"),
    (dict(hicache_write_policy="write_through_selective"), "--hicache-write-policy.*host tier.*or an L3 store"),
    (dict(enable_hierarchical_cache=True, write_through_threshold=3), "--write-through-threshold.*selective"),
]


@pytest.mark.parametrize("settings,message", NOT_IN_EFFECT, ids=[next(iter(s)) if len(s) == 1 else "threshold"
                                                                 for s, _ in NOT_IN_EFFECT])
def test_a_setting_that_would_not_take_effect_is_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        Engine("tiny-hybrid", **settings)


def test_the_same_settings_with_their_tier_are_accepted(tmp_path):
    store = FileBackend(str(tmp_path))
    eng = Engine("tiny-hybrid", storage=store, prefetch_threshold=64, io_timeout=5.0, rank=1,
                 hicache_storage_prefetch_policy="wait_complete", enable_hierarchical_cache=True, hicache_ratio=4.0,
                 hicache_write_policy="write_through_selective", write_through_threshold=3)
    assert eng.storage.threshold == 64 and eng.storage.io_timeout == 5.0
    eng.close()


def test_a_backend_and_a_backend_name_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="both given"):
        Engine("tiny-hybrid", storage=FileBackend(str(tmp_path)), hicache_storage_backend="file")


def test_a_tier_key_given_twice_with_two_values_is_refused(tmp_path):
    extra = json.dumps({"path": str(tmp_path), "prefetch_threshold": 64})
    with pytest.raises(ValueError, match="prefetch_threshold is given twice"):
        Engine("tiny-hybrid", hicache_storage_backend="file", hicache_storage_backend_extra_config=extra,
               prefetch_threshold=32)


def test_the_command_line_refuses_them_too(capsys):
    from uniradix.cli import main
    assert main(["run", "--hicache-ratio", "4", "--no-progress", "--clients", "1", "--rounds", "1"]) == 2
    assert "--hicache-ratio has no effect without the host tier" in capsys.readouterr().err
