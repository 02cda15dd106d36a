"""The multi-turn workload and `uniradix run`: what each round reports is what the
requests did, and the hit rate is summed over a round, not averaged."""
import json

import pytest

from uniradix.bench import MultiTurnWorkload, run_multiturn
from uniradix.cli import main
from uniradix.engine import Engine


def test_each_round_extends_the_conversation_and_reuses_it():
    wl = MultiTurnWorkload(clients=3, rounds=3, tokens_per_round=12, output_tokens=4, shared_prefix_tokens=8)
    eng = Engine("tiny-hybrid", max_total_tokens=2048)
    rounds = run_multiturn(eng, wl)
    assert [r.round for r in rounds] == [1, 2, 3]
    # round k's prompt: shared prefix + k * new tokens + (k - 1) outputs, per client
    for k, r in enumerate(rounds, 1):
        assert r.prompt_tokens == wl.clients * (8 + 12 * k + 4 * (k - 1))
        assert r.errors == 0 and len(r.ttfts) == wl.clients
    # round 1: nothing cached yet (all clients in flight together)
    assert rounds[0].cached_tokens == 0
    # later rounds reuse the previous turn up to its last computed token
    for k in (2, 3):
        prev = rounds[k - 2].prompt_tokens + wl.clients * (4 - 1)
        assert rounds[k - 1].cached_tokens == prev
        assert rounds[k - 1].computed_tokens == rounds[k - 1].prompt_tokens - prev
    # summed, not averaged per request
    r = rounds[2]
    assert r.hit_rate == pytest.approx(r.cached_tokens / r.prompt_tokens)
    assert eng.stats()["cache"]["sessions"] == 0  # closed at the end


def test_cache_off_reuses_nothing_and_gives_the_same_outputs():
    wl = MultiTurnWorkload(clients=2, rounds=2, tokens_per_round=10, output_tokens=3, shared_prefix_tokens=4)
    outputs = {True: [], False: []}
    on = run_multiturn(Engine("tiny-hybrid", max_total_tokens=1024), wl,
                       lambda r: outputs[True].append((r.input_ids, r.output_ids)))
    off = run_multiturn(Engine("tiny-hybrid", max_total_tokens=1024, disable_radix_cache=True), wl,
                        lambda r: outputs[False].append((r.input_ids, r.output_ids)))
    assert sum(r.cached_tokens for r in off) == 0
    assert sum(r.cached_tokens for r in on) > 0
    # the same prompts and the same greedy outputs, turn by turn
    assert sorted(outputs[True]) == sorted(outputs[False]) and len(outputs[True]) == 4


def test_run_prints_rounds_as_json(capsys):
    rc = main(["run", "--clients", "2", "--rounds", "3", "--tokens-per-round", "8", "--output-tokens", "2",
               "--shared-prefix-tokens", "4", "--page-size", "4", "--no-progress", "--json"])
    assert rc == 0
    printed = capsys.readouterr()
    out = json.loads(printed.out)  # stdout is one JSON document; the header line goes to stderr
    assert "uniradix run: tiny-hybrid" in printed.err
    rounds = out["rounds"]
    assert len(rounds) == 3
    assert rounds[0]["cached_tokens"] == 0 and rounds[2]["cached_tokens"] > 0
    assert all(r["errors"] == 0 for r in rounds)
    assert out["engine"]["finished"] == 6


def test_run_with_speculation_says_what_its_drafts_did(capsys):
    assert main(["run", "--clients", "2", "--rounds", "2", "--tokens-per-round", "8", "--output-tokens", "6",
                 "--speculative-algorithm", "NGRAM+SUFFIX", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "speculation (NGRAM+SUFFIX): " in out and "verify steps" in out


def test_run_prints_a_table(capsys):
    assert main(["run", "--clients", "2", "--rounds", "2", "--tokens-per-round", "8", "--output-tokens", "2",
                 "--model-preset", "jamba-like", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "hit rate" in out and "jamba-like" in out
    assert out.count("\n") >= 5


@pytest.mark.parametrize("flags, message", [
    (["--clients", "0"], "clients"),
    (["--page-size", "0"], "--page-size"),
    (["--max-total-tokens", "0"], "--max-total-tokens"),
    (["--swa-full-tokens-ratio", "inf"], "--swa-full-tokens-ratio"),
    (["--swa-full-tokens-ratio", "nan"], "--swa-full-tokens-ratio"),
    (["--device", "bogus"], "--device"),
    (["--device", "meta"], "--device"),
    (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
      '{"prefetch_timeout_base": null}'], "prefetch_timeout_base"),
    (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
      '{"prefetch_timeout_max": "nan"}'], "prefetch_timeout_max"),
    (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
      '{"prefetch_timeout_per_ki_token": NaN}'], "prefetch_timeout_per_ki_token"),
    (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
      '{"prefetch_threshold": 2.5}'], "prefetch_threshold"),
    (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
      '{"prefetch_treshold": 8}'], "prefetch_treshold"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
    (["--max-running-requests", "0"], "--max-running-requests"),
    (["--max-mamba-cache-size", "200000000"], "--max-mamba-cache-size"),
    (["--enable-hierarchical-cache", "--hicache-ratio", "1"], "--hicache-ratio"),
    (["--enable-hierarchical-cache", "--hicache-size", "0.000001"], "--hicache-size"),
    (["--hicache-write-policy", "write_back"], "--enable-hierarchical-cache"),
    (["--first-round-tokens", "0"], "--first-round-tokens"),
    (["--speculative-num-draft-tokens", "3"], "no effect without speculative decoding"),
    (["--speculative-config", '{"method": "eagle"}'], "--speculative-config"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "0"], "--speculative-num-draft-tokens"),
])
def test_bad_flags_are_clear_errors(capsys, flags, message):
    assert main(["run", "--no-progress", *flags]) == 2
    assert message in capsys.readouterr().err


def test_run_exits_nonzero_and_says_why_when_requests_fail(capsys):
    """Every request can never fit: the run says why, reports no invented throughput or
    TTFT for rounds that served nothing, and exits 1."""
    args = ["run", "--clients", "2", "--rounds", "2", "--tokens-per-round", "64", "--output-tokens", "2",
            "--shared-prefix-tokens", "0", "--max-total-tokens", "32", "--no-progress"]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert "4 of 4 requests failed" in err and "can never fit" in err and "--max-total-tokens" in err
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("1", "2", "all")]
    assert len(rows) == 3
    for row in rows:  # round, prompt, cached, hit rate, TTFT, input tok/s, errors
        assert row[3:6] == ["-", "-", "-"], row
    assert main([*args, "--json"]) == 1
    rounds = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rounds"]
    assert all(r["input_throughput"] is None and r["ttft_mean_s"] is None and r["errors"] == 2 for r in rounds)
    assert "can never fit" in rounds[0]["error_messages"][0]


def test_run_help_states_each_default_once(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("default: tiny-hybrid") == 1 and "default: None" not in out


def test_run_loads_weights_from_a_safetensors_file(tmp_path, capsys):
    from uniradix.model import init_weights, preset, save_weights
    cfg = preset("tiny-hybrid")
    good = tmp_path / "w.safetensors"
    save_weights(init_weights(cfg.with_(seed=5)), good, cfg=cfg.with_(seed=5))
    args = ["run", "--clients", "1", "--rounds", "1", "--tokens-per-round", "4", "--output-tokens", "1",
            "--no-progress", "--json"]
    assert main([*args, "--model-path", str(good)]) == 0
    other = preset("gemma3-like")
    bad = tmp_path / "other.safetensors"
    save_weights(init_weights(other), bad, cfg=other)
    capsys.readouterr()
    assert main([*args, "--model-path", str(bad)]) == 2
    assert "layer pattern" in capsys.readouterr().err
    assert main([*args, "--model-path", str(tmp_path / "missing.safetensors")]) == 2


def test_run_with_l3_storage_reuses_across_processes(tmp_path, capsys):
    extra = json.dumps({"path": str(tmp_path / "l3"), "prefetch_threshold": 8})
    args = ["run", "--clients", "2", "--rounds", "2", "--tokens-per-round", "16", "--output-tokens", "2",
            "--shared-prefix-tokens", "0", "--no-progress", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", extra]
    assert main([*args, "--json"]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["rounds"][0]["cached_tokens"] == 0 and first["engine"]["storage_saved_objects"] > 0
    assert main([*args, "--json"]) == 0  # a fresh engine over the same store
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert second["rounds"][0]["cached_tokens"] > 0 and second["engine"]["storage_tokens"] > 0
    assert main(args) == 0
    assert "L3 (file)" in capsys.readouterr().out
    assert main([*args[:-1], "{broken"]) == 2


def test_first_round_tokens_give_each_client_a_document():
    wl = MultiTurnWorkload(clients=2, rounds=3, tokens_per_round=6, output_tokens=2, shared_prefix_tokens=4,
                           first_round_tokens=40)
    eng = Engine("tiny-hybrid", max_total_tokens=2048)
    rounds = run_multiturn(eng, wl)
    for k, r in enumerate(rounds, 1):
        assert r.prompt_tokens == wl.clients * (4 + 40 + 6 * (k - 1) + 2 * (k - 1))
    assert wl.final_context == 4 + 40 + 2 * 6 + 3 * 2
    # the documents differ per client: round 1 shares only the system prompt
    assert rounds[0].cached_tokens <= wl.clients * 4


def test_run_with_the_host_tier_serves_turns_from_host(capsys):
    """Device pools that hold about one conversation: later turns come back from L2."""
    args = ["run", "--clients", "4", "--rounds", "3", "--tokens-per-round", "8", "--output-tokens", "2",
            "--first-round-tokens", "96", "--shared-prefix-tokens", "0", "--page-size", "4",
            "--max-total-tokens", "256", "--enable-hierarchical-cache", "--hicache-ratio", "4",
            "--no-progress"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    eng = out["engine"]
    assert eng["host_tokens"] > 0 and eng["errors"] == 0
    assert eng["cache"]["host"]["written_handles"] > 0
    assert out["rounds"][2]["cached_tokens"] > 0.8 * out["rounds"][2]["prompt_tokens"]
    assert main(args) == 0
    assert "L2 (host" in capsys.readouterr().out


def test_run_keeps_checkpoints_of_one_preset_apart_in_l3(tmp_path, capsys):
    """--model-path with other weights of the same preset must not reuse the first
    file's L3 data; the same file again does (its fingerprint is cached on disk)."""
    from uniradix.model import init_weights, preset, save_weights
    cfg = preset("tiny-hybrid")
    files = {}
    for seed in (1, 2):
        files[seed] = tmp_path / f"w{seed}.safetensors"
        save_weights(init_weights(cfg.with_(seed=seed)), files[seed], cfg=cfg)
    extra = json.dumps({"path": str(tmp_path / "l3"), "prefetch_threshold": 8})
    args = ["run", "--clients", "1", "--rounds", "1", "--tokens-per-round", "24", "--output-tokens", "2",
            "--shared-prefix-tokens", "0", "--no-progress", "--json", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", extra]

    def storage_tokens(seed):
        assert main([*args, "--model-path", str(files[seed])]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["engine"]["storage_tokens"]

    assert storage_tokens(1) == 0
    assert storage_tokens(2) == 0   # other weights, same preset: nothing shared
    assert storage_tokens(1) > 0    # the first file again
    named = json.dumps({"path": str(tmp_path / "l3"), "prefetch_threshold": 8, "model_fingerprint": "acme/m"})
    assert main([*args[:-1], named, "--model-path", str(files[2])]) == 0
    capsys.readouterr()
    assert main([*args[:-1], json.dumps({"path": str(tmp_path / "l3"), "auth_secret": ""})]) == 2
    err = capsys.readouterr().err
    assert "auth_secret" in err


def test_tier_settings_and_backend_settings_split_on_one_list():
    """The extra config's tier keys are declared once (config.StorageConfig): the
    backends leave out exactly those, and each is a storage setting."""
    from uniradix.config import StorageConfig
    from uniradix.hicache.backends import TIER_KEYS
    assert TIER_KEYS == StorageConfig.tier_keys()
    assert set(TIER_KEYS) == {"prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                              "prefetch_timeout_max", "io_timeout", "model_fingerprint", "auth_secret", "announce_interval",
                              "allow_unavailable_at_start"}


def test_habits_from_sglang_and_vllm(capsys):
    """--version answers; a flag the subcommand lacks gets the subcommand's own usage; a
    parallelism flag says what to do instead; bench multiturn takes SGLang's names."""
    from importlib.metadata import version
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"uniradix {version('uniradix')}"
    for cmd in (["serve"], ["run"], ["simulate", "log.jsonl"], ["bench", "multiturn", "--url", "http://127.0.0.1:1"]):
        with pytest.raises(SystemExit) as e:
            main([*cmd, "--no-such-flag"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"uniradix {cmd[0] if cmd[0] != 'bench' else 'bench multiturn'}: error" in err
        assert "unrecognized arguments: --no-such-flag" in err
    for flag in (["--tp", "2"], ["--tensor-parallel-size=2"], ["--dp-size", "2"]):
        with pytest.raises(SystemExit):
            main(["serve", *flag])
        err = capsys.readouterr().err
        assert "uniradix serve: error" in err and "one device" in err and "smg" in err
    from uniradix.bench import http_multiturn
    import argparse
    p = argparse.ArgumentParser()
    http_multiturn.add_args(p)
    a = p.parse_args(["--url", "http://127.0.0.1:1", "--num-clients", "3", "--num-rounds", "4"])
    assert (a.clients, a.rounds) == (3, 4)
