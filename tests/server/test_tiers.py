"""The tiers through the server: after /flush_cache empties the device (and host) tier, a
repeated prompt comes back from L2 or L3, and both meta_info's split and /metrics say
which tier served it."""
import json

from server_proc import ServerProc


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
        m = s.wait_idle()
        assert m['uniradix_cached_tokens_total{tier="storage"}'] == split["storage"]
        assert m["uniradix_storage_hits_total"] >= 1 and m["uniradix_storage_read_bytes_total"] > 0
        assert m["uniradix_storage_written_bytes_total"] > 0 and m["uniradix_storage_errors_total"] == 0
        assert m["uniradix_host_written_handles_total"] > 0
        assert s.audit()["settled"]
    finally:
        assert s.stop() == 0
