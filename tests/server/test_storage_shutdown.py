"""A server over a store that stopped answering: a request waiting for its read
(wait_complete) holds neither /metrics nor the other requests, and SIGTERM stops the
process within the graceful timeout (the storage threads cannot keep it alive)."""
import json
import os
import threading
import time
from pathlib import Path

import pytest
from server_proc import HANG_S, ServerProc

GRACEFUL_S = 2
#: what a stop may take past the graceful timeout on a loaded machine: a guard that the
#: store cannot keep the process alive (its reads would wait io_timeout, 600 s), no more
EXIT_S = 120


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
        deadline = time.monotonic() + HANG_S
        while True:   # every scrape answers while the request waits for the store
            m = s.metrics()
            if m["uniradix_running_requests"] == 1:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
        assert s.metrics()["uniradix_running_requests"] == 1
        assert s.get("/health")[0] == 200
    finally:
        code = s.stop(timeout=GRACEFUL_S + EXIT_S)   # a guard: killed, and an error, if it hangs
    assert code == 0, "".join(s.lines[-30:])
    waiting.join(HANG_S)
    assert answers and answers[0][0] in (200, 503), answers   # the waiting request was answered


def test_a_backend_whose_close_hangs_does_not_hold_the_exit(tmp_path):
    """The backend is closed within what is left of the graceful timeout; one that never
    returns (a native client waiting on a store that stopped answering) is left behind,
    and the process ends with its status without running the teardown under it."""
    here = str(Path(__file__).resolve().parent)
    extra = {"module_path": "hanging_store", "class_name": "HangingClose", "path": str(tmp_path),
             "prefetch_threshold": 1}
    s = ServerProc("--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                   json.dumps(extra), "--graceful-timeout", str(GRACEFUL_S), "--max-total-tokens", "2048",
                   env={"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])})
    try:
        body = {"input_ids": list(range(3, 60)), "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        code, out, _ = s.post("/generate", body)
        assert code == 200, out
    finally:
        code = s.stop(timeout=GRACEFUL_S + EXIT_S)   # a guard: killed, and an error, if it hangs
    assert code == 0, "".join(s.lines[-30:])
    log = "".join(s.lines)
    assert "closing the L3 backend did not end within the graceful timeout" in log
    assert "still stuck in the store at exit" in log


@pytest.mark.slow
def test_sigterm_with_a_mooncake_master_that_stopped_answering(tmp_path):
    """The real case: a Mooncake master that hangs (SIGSTOP) under a write_back server
    with data to write down. SIGTERM ends the process with status 0 (not SIGSEGV from the
    client's teardown under a call still inside it) within the graceful timeout."""
    import signal
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hicache"))
    from mooncake_master import master_server
    with master_server() as m:
        extra = {"master": m.address, "prefetch_threshold": 1, "op_timeout": 1}
        s = ServerProc("--enable-hierarchical-cache", "--hicache-write-policy", "write_back",
                       "--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config",
                       json.dumps(extra), "--graceful-timeout", "4", "--page-size", "4")
        try:
            body = {"input_ids": list(range(3, 90)), "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
            code, out, _ = s.post("/generate", body)
            assert code == 200, out
            os.kill(m.pid, signal.SIGSTOP)
            code, out, _ = s.post("/generate", {**body, "input_ids": body["input_ids"] + [5, 6]})
            assert code == 200, out
        finally:
            try:
                code = s.stop(timeout=4 + EXIT_S)   # a guard: killed, and an error, if it hangs
            finally:
                os.kill(m.pid, signal.SIGCONT)
        assert code == 0, "".join(s.lines[-30:])
