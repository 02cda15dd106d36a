"""`uniradix simulate`: a request log with token ids replayed on the real scheduler and
tree with pools that only count. It must agree with the server it came from (request
for request, on every tier), with the real engine on the same traffic (every family,
page sizes, preemption), keep the log's causality, and find the smallest pool that
reaches a target."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from uniradix.bench import simulate  # noqa: E402
from uniradix.cli import main  # noqa: E402
from uniradix.engine import Engine  # noqa: E402
from uniradix.engine.replay import ReplayEngine  # noqa: E402
from uniradix.engine.request import Request, SamplingParams  # noqa: E402


def _multiturn(url: str, tmp_path, parallel: int = 1, rounds: int = 3) -> None:
    assert main(["bench", "multiturn", "--url", url, "--clients", "4", "--rounds", str(rounds),
                 "--preamble-words", "20", "--document-words", "60", "--new-words", "20", "--output-tokens", "6",
                 "--max-parallel", str(parallel), "--no-progress", "--seed", "3"]) == 0


def test_a_replay_at_the_servers_sizes_reuses_what_the_server_did(tmp_path, capsys):
    """Sequential clients, device pools too small for the conversations and a host
    tier twice that: the log replayed at the settings its start line records gives each
    request the cached tokens, per tier, that the server gave it."""
    from server_proc import ServerProc
    log = tmp_path / "requests.jsonl"
    s = ServerProc("--max-total-tokens", "1536", "--enable-hierarchical-cache", "--hicache-ratio", "2",
                   "--request-log", str(log), "--log-token-ids")
    try:
        _multiturn(f"http://127.0.0.1:{s.port}", tmp_path)
        capsys.readouterr()
    finally:
        assert s.stop() == 0, "".join(s.lines[-30:])
    traffic = simulate.read_log(str(log))
    assert len(traffic.requests) == 12 and traffic.settings["max_total_tokens"] == 1536
    served = [r.cached for r in traffic.requests]
    assert sum(c["cached_host"] for c in served) > 0 and sum(c["cached_device"] for c in served) > 0, served
    got = _replayed(traffic, simulate.server_config(traffic))
    assert len(got) == 12
    for lg, m in got:
        assert (m.cached_tokens, m.host_tokens, m.storage_tokens) == \
            (lg.cached["cached_tokens"], lg.cached["cached_host"], lg.cached["cached_storage"]), lg.round
    # the command says the same: "as served" and the replay's row
    assert main(["simulate", str(log)]) == 0
    out = capsys.readouterr().out
    as_served = out.split("as served: hit rate ")[1].split()[0]
    row = next(line for line in out.splitlines() if line.strip().startswith("1 ") and "1,536" in line)
    assert as_served in row.split(), out


def _replayed(traffic, config) -> list:
    """(logged request, replayed metrics) per request, from simulate.replay."""
    got, orig = [], simulate._count
    try:
        simulate._count = lambda res, lg, req: (got.append((lg, req.metrics)), orig(res, lg, req))
        res = simulate.replay(traffic, simulate.load_replay_model(traffic, None, None, None), config)
    finally:
        simulate._count = orig
    assert res.errors == 0
    return got


@pytest.mark.parametrize("name", ["tiny-hybrid", "full-only"])
def test_a_replay_over_l3_reuses_what_the_engine_did(tmp_path, name):
    """An engine over a file store that requests wait for, one turn at a time (each run
    ends with its writes in the store), against the replay's store that answers at
    once: the same tokens from each tier, the store's included."""
    from uniradix.hicache.backends.file import FileBackend
    kw = dict(page_size=1, max_total_tokens=400, max_mamba_cache_size=24, prefetch_threshold=8,
              hicache_storage_prefetch_policy="wait_complete")
    eng = Engine(name, storage=FileBackend(str(tmp_path / "l3")), **kw)
    rng, recs, t = random.Random(9), [], 0.0
    convs = [[rng.randrange(256) for _ in range(90)] for _ in range(4)]
    for _ in range(3):
        for i, c in enumerate(convs):
            r = Request(input_ids=c, session_id=f"c{i}", sampling=SamplingParams(max_new_tokens=4))
            eng.run([r])
            m = r.metrics
            recs.append({**_rec(t, t + 0.5, r.input_ids, r.output_ids, session=f"c{i}"), "cached_tokens": m.cached_tokens,
                         "cached_host": m.host_tokens, "cached_storage": m.storage_tokens})
            convs[i] = r.input_ids + r.output_ids + [rng.randrange(256) for _ in range(15)]
            t += 1.0
    eng.close()
    assert sum(r["cached_storage"] for r in recs) > 0
    traffic = simulate.read_log(_write(tmp_path / "log.jsonl", recs))
    traffic.settings = {"model_preset": name}
    got = _replayed(traffic, {**simulate.server_config(traffic), **kw, "storage": "on"})
    assert [(m.cached_tokens, m.storage_tokens) for _, m in got] == \
           [(r["cached_tokens"], r["cached_storage"]) for r in recs]


@pytest.mark.parametrize("name", ["tiny-hybrid", "qwen3-next-like", "gemma3-like", "gpt-oss-like", "full-only"])
@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("host", [False, True])
def test_the_replay_engine_reuses_what_the_real_engine_does(name, page, host):
    """The same requests in the same batches: the real engine (computing) and the
    replay engine (nothing computed, the real outputs forced) reuse the same tokens
    from the same tiers, and preempt the same requests."""
    kw = dict(page_size=page, max_total_tokens=256, max_mamba_cache_size=24, enable_hierarchical_cache=host)
    real, rep = Engine(name, **kw), ReplayEngine(name, **kw)
    rng = random.Random(3)
    convs = [[rng.randrange(256) for _ in range(30)] for _ in range(5)]
    for _ in range(3):
        reqs = [Request(input_ids=c, session_id=i, sampling=SamplingParams(max_new_tokens=5))
                for i, c in enumerate(convs)]
        real.run(reqs)
        reps = [rep.replay(r.input_ids, r.output_ids, session_id=i) for i, r in enumerate(reqs)]
        rep.run(reps)
        assert [(r.metrics.cached_tokens, r.metrics.host_tokens) for r in reqs] == \
               [(r.metrics.cached_tokens, r.metrics.host_tokens) for r in reps]
        assert [r.output_ids for r in reps] == [r.output_ids for r in reqs]
        convs = [r.input_ids + r.output_ids + [rng.randrange(256) for _ in range(10)] for r in reqs]
    assert rep.counters["preemptions"] == real.counters["preemptions"]
    assert all(p.accounting_only for p in rep.pools.values())
    rep.audit(settled=True)


def _rec(t_arrive, t_finish, ids, out, **kw):
    return {"time": t_finish, "latency": t_finish - t_arrive, "prompt_tokens": len(ids), "cached_tokens": 0,
            "input_ids": ids, "output_ids": out, "status": "finished", **kw}


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_the_replay_keeps_the_logs_causality(tmp_path):
    """A turn that arrived after the one it extends finished reuses all of it; one that
    arrived while it ran cannot reuse its output, so it reuses the prompt it shares,
    because both run together (in-batch sharing)."""
    a = list(range(1, 41))
    out = [200, 201, 202, 203]
    follow = a + out + [7, 8, 9]
    after = simulate.read_log(_write(tmp_path / "after.jsonl", [_rec(0.0, 1.0, a, out), _rec(1.5, 2.0, follow, [5])]))
    during = simulate.read_log(_write(tmp_path / "during.jsonl", [_rec(0.0, 1.0, a, out), _rec(0.5, 2.0, follow, [5])]))
    model = simulate.load_replay_model(after, None, "tiny-hybrid", None)
    conf = {**simulate.server_config(after), "max_total_tokens": 4096}
    r_after, r_during = simulate.replay(after, model, conf), simulate.replay(during, model, conf)
    assert r_after.cached["cached_tokens"] == len(a) + len(out) - 1  # all but the last token it computed
    assert r_during.cached["cached_tokens"] == len(a) - 1 and r_during.rates["cached_device"] > 0


def test_closed_sessions_close_in_the_replay(tmp_path):
    recs = [_rec(0.0, 1.0, list(range(1, 30)), [3, 4], session="s1"),
            {"time": 1.2, "event": "close_session", "session": "s1"},
            _rec(1.5, 2.0, list(range(40, 70)), [3, 4], session="s2")]
    traffic = simulate.read_log(_write(tmp_path / "log.jsonl", recs))
    assert traffic.closes == [(1.2, "s1", None)] and [r.round for r in traffic.requests] == [1, 1]
    model = simulate.load_replay_model(traffic, None, "tiny-hybrid", None)
    res = simulate.replay(traffic, model, simulate.server_config(traffic))
    assert res.sessions_open == 1  # s2's reference stays; s1's went with its close
    res = simulate.replay(traffic, model, {**simulate.server_config(traffic), "sessions": "off"})
    assert res.sessions_open == 0


def test_a_close_closes_its_own_tenants_session_only(tmp_path):
    """Two tenants' sessions of one id (the log's salt digests tell them apart): the
    logged close of one leaves the other's reference in the replay."""
    recs = [_rec(0.0, 1.0, list(range(1, 30)), [3, 4], session="s1", salt="d-alice"),
            _rec(0.0, 1.0, list(range(40, 70)), [3, 4], session="s1", salt="d-bob"),
            {"time": 1.2, "event": "close_session", "session": "s1", "salt": "d-bob"}]
    traffic = simulate.read_log(_write(tmp_path / "log.jsonl", recs))
    assert traffic.closes == [(1.2, "s1", "d-bob")]
    model = simulate.load_replay_model(traffic, None, "tiny-hybrid", None)
    assert simulate.replay(traffic, model, simulate.server_config(traffic)).sessions_open == 1


def test_the_target_is_the_smallest_l1_that_reaches_it(tmp_path, capsys):
    rng = random.Random(5)
    docs = [[rng.randrange(256) for _ in range(120)] for _ in range(4)]
    recs, t = [], 0.0
    for turn in range(3):  # four conversations, one request at a time, round-robin
        for i, d in enumerate(docs):
            out = [rng.randrange(256) for _ in range(4)]
            recs.append(_rec(t, t + 0.5, list(d), out, session=f"c{i}"))
            docs[i] = d + out + [rng.randrange(256) for _ in range(20)]
            t += 1.0
    log = _write(tmp_path / "log.jsonl", recs)
    assert main(["simulate", log, "--model-preset", "tiny-hybrid", "--max-total-tokens", "256,4096",
                 "--page-size", "4", "--target", "0.6", "--by-round"]) == 0
    out = capsys.readouterr().out
    assert "hit rate by round" in out
    n = int(out.split("L1 alone needs --max-total-tokens ")[1].split()[0].replace(",", ""))
    traffic = simulate.read_log(log)
    model = simulate.load_replay_model(traffic, None, "tiny-hybrid", None)
    conf = {**simulate.server_config(traffic), "page_size": 4}
    assert simulate.replay(traffic, model, {**conf, "max_total_tokens": n}).hit_rate >= 0.6
    largest = max(len(r.input_ids) + len(r.output_ids) for r in traffic.requests)
    assert n - 4 < largest or simulate.replay(traffic, model, {**conf, "max_total_tokens": n - 4}).hit_rate < 0.6
    assert simulate.smallest(lambda x: x >= 37, 1, 100, 4) == 40 and simulate.smallest(lambda x: False, 1, 9, 1) is None


def test_what_cannot_be_replayed_is_one_line(tmp_path, capsys):
    no_ids = _write(tmp_path / "plain.jsonl", [{"time": 1.0, "prompt_tokens": 5, "cached_tokens": 0}])
    assert main(["simulate", no_ids]) == 1
    assert "--log-token-ids" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "absent.jsonl")]) == 2
    ok = _write(tmp_path / "ok.jsonl", [_rec(0.0, 1.0, [1, 2, 3], [4])])
    for bad in (["--storage", "maybe"], ["--max-total-tokens", "lots"], ["--target", "1.5"],
                ["--radix-eviction-policy", "newest"], ["--hicache-ratio", "0.5"]):
        assert main(["simulate", ok, "--model-preset", "tiny-hybrid", *bad]) == 2, bad
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--storage" in err and "--target" in err


def test_token_ids_need_the_request_log():
    import subprocess
    out = subprocess.run([sys.executable, "-m", "uniradix.cli", "serve", "--port", "0", "--log-token-ids"],
                         capture_output=True, text=True, timeout=600)   # a guard against a hang only
    assert out.returncode == 2 and "--request-log" in out.stderr and "Traceback" not in out.stderr, out.stderr
