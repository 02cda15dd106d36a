"""Two servers over one shared L3 (a real redis-server, a real Mooncake master): each
announces itself in the namespace and sees the other; a conversation started on one
continues on the other from L3, exactly as the cache-off engine answers it, with the
tokens it reused counted as written by another instance; a server that stops is seen
gone. Objects a server wrote itself never count as cross-instance."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from server_proc import HANG_S, ServerProc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hicache"))

from uniradix.engine import Engine, Request, SamplingParams  # noqa: E402

BEAT_S = 0.5


def reference(ids: list[int], n: int) -> list[int]:
    """The cache-off engine's greedy answer on the embedded model."""
    eng = Engine("tiny-hybrid", page_size=4, disable_radix_cache=True)
    req = Request(input_ids=ids, sampling=SamplingParams(max_new_tokens=n, temperature=0))
    eng.run([req])
    return req.output_ids


@pytest.fixture(params=["redis", "mooncake"])
def store(request):
    """(backend name, extra config) of a store both servers share."""
    if request.param == "redis":
        from redis_server import redis_server
        with redis_server() as srv:
            yield "redis", {"url": srv.url}
    else:
        from backend_contract import MOONCAKE_SIZES
        from mooncake_master import master_server
        with master_server() as m:
            yield "mooncake", {"master": m.address, **MOONCAKE_SIZES}


def start(backend: str, extra: dict) -> ServerProc:
    return ServerProc("--page-size", "4", "--hicache-storage-backend", backend,
                      "--hicache-storage-backend-extra-config",
                      json.dumps({**extra, "announce_interval": BEAT_S, "prefetch_threshold": 8}),
                      "--hicache-storage-prefetch-policy", "wait_complete")


def until(what, timeout: float = HANG_S):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.1)


def instances(s: ServerProc) -> dict:
    status, info, _ = s.get("/get_server_info")
    assert status == 200
    return info["l3_instances"]


def written_down(s: ServerProc) -> bool:
    return s.wait_idle()["uniradix_storage_pending_writes"] == 0


def test_a_conversation_continues_on_another_server_from_l3(store):
    backend, extra = store
    a, b = start(backend, extra), start(backend, extra)
    try:
        # each sees the other announce itself (and not itself)
        ia = until(lambda: (i := instances(a))["others"] and i)
        ib = until(lambda: (i := instances(b))["others"] and i)
        assert [o["instance"] for o in ia["others"]] == [ib["this_instance"]] != [ia["this_instance"]]
        assert ib["others"][0]["url"] == f"http://127.0.0.1:{a.port}" and ib["others"][0]["pid"] > 0
        assert a.metrics()["uniradix_storage_instances_seen"] == 1

        turn1 = [(7 * i) % 250 + 1 for i in range(90)]
        code, out1, _ = a.post("/generate", {"input_ids": turn1, "session_id": "c",
                                            "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
        assert code == 200, out1
        until(lambda: written_down(a))
        turn2 = turn1 + out1["output_ids"] + [11, 12, 13, 14, 15]
        code, out2, _ = b.post("/generate", {"input_ids": turn2, "session_id": "c",
                                            "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
        assert code == 200, out2
        split = out2["meta_info"]["cached_tokens_details"]
        cross = out2["meta_info"]["cached_tokens_cross_instance"]
        assert split["storage"] == cross >= 88, split   # A's 96 tokens, page-aligned
        assert out2["output_ids"] == reference(turn2, 6)                 # exact
        mb = b.wait_idle()
        assert mb["uniradix_cached_tokens_cross_instance_total"] == cross

        # back on A, from A's own objects and device: none of it is another instance's
        until(lambda: written_down(b))
        assert a.post("/flush_cache")[0] == 200   # device emptied: what A reuses now is L3
        turn3 = turn2 + out2["output_ids"] + [21, 22, 23]
        code, out3, _ = a.post("/generate", {"input_ids": turn3,
                                            "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert code == 200, out3
        split3 = out3["meta_info"]["cached_tokens_details"]
        cross3 = out3["meta_info"]["cached_tokens_cross_instance"]
        assert split3["storage"] >= 100 and 0 < cross3 < split3["storage"], (split3, cross3)
        assert out3["output_ids"] == reference(turn3, 4)
    finally:
        code_b = b.stop()
    assert code_b == 0
    try:   # B's record went with it: A sees no one
        until(lambda: not instances(a)["others"])
        assert a.metrics()["uniradix_storage_instances_seen"] == 0
    finally:
        assert a.stop() == 0
