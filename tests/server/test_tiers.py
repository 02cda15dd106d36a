"""The tiers through the server: after /flush_cache empties the device (and host) tier, a
repeated prompt comes back from L2 or L3, and both meta_info's split and /metrics say
which tier served it."""
import json
import threading
import time

from server_proc import HANG_S, ServerProc


def test_storage_and_host_tiers_report_their_tokens(tmp_path):
    s = ServerProc("--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                   "--hicache-storage-backend-extra-config", json.dumps({"path": str(tmp_path),
                                                                          "prefetch_threshold": 1}),
                   "--max-total-tokens", "2048")
    try:
        ids = [3 + (i * 11) % 250 for i in range(300)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        code, first, _ = s.post("/generate", body)
        assert code == 200, first
        s.wait_idle()
        assert s.post("/flush_cache")[0] == 200  # device and host emptied; the store keeps its objects
        code, again, _ = s.post("/generate", body)
        assert code == 200, again
        split = again["meta_info"]["cached_tokens_details"]
        assert again["output_ids"] == first["output_ids"]
        assert split["storage"] > 0, (split, s.metrics())
        assert sum(split.values()) == again["meta_info"]["cached_tokens"]
        assert again["meta_info"]["cached_tokens_cross_instance"] == 0  # its own objects: this instance wrote them
        m = s.wait_idle()
        assert m['uniradix_cached_tokens_total{tier="storage"}'] == split["storage"]
        assert m["uniradix_storage_hits_total"] >= 1 and m["uniradix_storage_read_bytes_total"] > 0
        assert m["uniradix_storage_written_bytes_total"] > 0 and m["uniradix_storage_errors_total"] == 0
        assert m["uniradix_host_written_handles_total"] > 0
        assert s.audit()["settled"]
    finally:
        assert s.stop() == 0


WRITE_BACK = ("--enable-hierarchical-cache", "--hicache-write-policy", "write_back",
              "--hicache-storage-backend", "file", "--page-size", "4", "--max-total-tokens", "2048")


def write_back_server(path) -> ServerProc:
    return ServerProc(*WRITE_BACK, "--hicache-storage-backend-extra-config",
                      json.dumps({"path": str(path), "prefetch_threshold": 1}))


def greedy(ids, n):
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}


def test_write_back_reaches_the_store_on_flush(tmp_path):
    """write_back writes to L3 only what the host evicts (nothing here: the pools are
    large); /flush_cache writes down what the device and host tiers alone hold before it
    drops them, so the same prompt then comes back from the store."""
    ids = [3 + (i * 7) % 250 for i in range(120)]
    s = write_back_server(tmp_path)
    try:
        code, first, _ = s.post("/generate", greedy(ids, 4))
        assert code == 200, first
        assert s.wait_idle()["uniradix_storage_written_bytes_total"] == 0  # nothing evicted: nothing written
        assert s.post("/flush_cache")[0] == 200
        code, again, _ = s.post("/generate", greedy(ids, 4))
        assert code == 200 and again["output_ids"] == first["output_ids"], again
        assert again["meta_info"]["cached_tokens_details"]["storage"] == 116, again["meta_info"]
    finally:
        assert s.stop() == 0, "".join(s.lines[-30:])


def test_write_back_reaches_the_store_on_sigterm(tmp_path):
    """A graceful shutdown writes down what only the device and host tiers hold: a new
    server on the store resumes the conversation where the first one stopped."""
    ids = [3 + (i * 5) % 250 for i in range(100)]
    s = write_back_server(tmp_path)
    try:
        code, first, _ = s.post("/generate", greedy(ids, 4))
        assert code == 200, first
        turn2 = ids + first["output_ids"] + [5, 6, 7, 8, 9]
        code, second, _ = s.post("/generate", greedy(turn2, 4))
        assert code == 200, second
        assert s.wait_idle()["uniradix_storage_written_bytes_total"] == 0
    finally:
        assert s.stop() == 0, "".join(s.lines[-30:])
    s = write_back_server(tmp_path)
    try:
        code, third, _ = s.post("/generate", greedy(turn2 + second["output_ids"] + [10, 11, 12], 2))
        assert code == 200, third
        done = len(turn2) + len(second["output_ids"]) - 1  # what the first server computed
        assert third["meta_info"]["cached_tokens_details"]["storage"] == done // 4 * 4, third["meta_info"]
    finally:
        assert s.stop() == 0, "".join(s.lines[-30:])


def test_sigterm_keeps_time_for_the_write_down_when_requests_run_to_the_limit(tmp_path):
    """A request still running at SIGTERM is aborted a quarter of --graceful-timeout
    before its end (with an L3), so the write-down of what the tiers hold still happens
    and the whole shutdown stays within the timeout."""
    ids = [3 + (i * 13) % 250 for i in range(100)]
    extra = json.dumps({"path": str(tmp_path), "prefetch_threshold": 1})
    flags = (*WRITE_BACK[:-1], "20000", "--hicache-storage-backend-extra-config", extra)
    s = ServerProc(*flags, "--graceful-timeout", "4")
    try:
        code, first, _ = s.post("/generate", greedy(ids, 4))
        assert code == 200, first
        assert s.wait_idle()["uniradix_storage_written_bytes_total"] == 0
        long = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 15000, "temperature": 0,
                                                             "ignore_eos": True}}
        out = []
        t = threading.Thread(target=lambda: out.append(s.post("/generate", long)))
        t.start()
        while s.metrics()["uniradix_running_requests"] < 1:
            time.sleep(0.02)
    finally:
        t0 = time.monotonic()
        assert s.stop() == 0, "".join(s.lines[-30:])
        took = time.monotonic() - t0
    t.join(HANG_S)
    assert out and out[0][0] == 503, out  # it ran to the limit and was aborted
    # the graceful timeout, and the process's own exit (generous: a loaded machine exits
    # slowly, while a shutdown that waited for the 15000-token request would take minutes)
    assert took < 4 + 60, took
    cut = [line for line in s.lines if "not written" in line or "abandoned" in line]
    assert not cut, cut  # the write-down had its time, and every write reached the store
    s = ServerProc(*flags)
    try:
        code, again, _ = s.post("/generate", greedy(ids + first["output_ids"] + [10, 11], 2))
        assert code == 200, again
        done = len(ids) + len(first["output_ids"]) - 1
        assert again["meta_info"]["cached_tokens_details"]["storage"] == done // 4 * 4, again["meta_info"]
    finally:
        assert s.stop() == 0, "".join(s.lines[-30:])


def test_a_flush_the_store_does_not_take_keeps_the_tiers_unless_forced(tmp_path):
    """Under write_back what only the device and host hold would be lost if the flush
    dropped it after a failed write-down: it answers 503 and keeps them (the prompt still
    comes back from the device); ?force=true drops them anyway."""
    import os
    from pathlib import Path
    here = str(Path(__file__).resolve().parent)
    extra = {"module_path": "hanging_store", "class_name": "RefusingWrites", "path": str(tmp_path),
             "prefetch_threshold": 1}
    s = ServerProc(*WRITE_BACK[:3], "--hicache-storage-backend", "dynamic", "--page-size", "4",
                   "--max-total-tokens", "2048", "--hicache-storage-backend-extra-config", json.dumps(extra),
                   env={"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])})
    ids = [3 + (i * 3) % 250 for i in range(60)]
    try:
        code, first, _ = s.post("/generate", greedy(ids, 2))
        assert code == 200, first
        code, body, headers = s.post("/flush_cache")
        assert code == 503 and "io_timeout" in body["error"]["message"], (code, body)
        code, again, _ = s.post("/generate", greedy(ids, 2))
        assert code == 200 and again["meta_info"]["cached_tokens_details"]["device"] == 56, again["meta_info"]
        assert s.metrics()["uniradix_storage_errors_total"] > 0
        assert s.post("/flush_cache?force=true")[0] == 200
        code, third, _ = s.post("/generate", greedy(ids, 2))
        assert code == 200 and third["meta_info"]["cached_tokens"] == 0, third["meta_info"]
        assert third["output_ids"] == first["output_ids"]
    finally:
        assert s.stop() == 0, "".join(s.lines[-30:])
