"""A server over a store that stopped answering: a request waiting for its read
(wait_complete) holds neither /metrics nor the other requests, and SIGTERM stops the
process within the graceful timeout (the storage threads cannot keep it alive)."""
import json
import os
import threading
import time
from pathlib import Path

from server_proc import ServerProc

GRACEFUL_S = 2


def test_a_hanging_store_blocks_neither_metrics_nor_shutdown(tmp_path):
    here = str(Path(__file__).resolve().parent)
    extra = {"module_path": "hanging_store", "class_name": "HangingStore", "path": str(tmp_path),
             "prefetch_threshold": 1, "io_timeout": 600}
    s = ServerProc("--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                   json.dumps(extra), "--hicache-storage-prefetch-policy", "wait_complete",
                   "--graceful-timeout", str(GRACEFUL_S), "--max-total-tokens", "2048",
                   env={"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])})
    answers = []
    body = {"input_ids": list(range(3, 60)), "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    waiting = threading.Thread(target=lambda: answers.append(s.post("/generate", body)), daemon=True)
    try:
        waiting.start()
        deadline = time.monotonic() + 60
        while True:   # every scrape answers while the request waits for the store
            m = s.metrics()
            if m["uniradix_running_requests"] == 1:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
        assert s.metrics()["uniradix_running_requests"] == 1
        assert s.get("/health")[0] == 200
    finally:
        code = s.stop(timeout=GRACEFUL_S + 30)   # a guard: killed, and an error, if it hangs
    assert code == 0, "".join(s.lines[-30:])
    waiting.join(10)
    assert answers and answers[0][0] in (200, 503), answers   # the waiting request was answered
