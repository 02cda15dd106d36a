"""A request log read by `uniradix hit-rate` and `uniradix simulate` is input from
outside: every hostile line is one line on stderr naming its line number and field, and
exit status 2 (never a traceback, a hang or a wrong figure), the same for both tools;
`--skip-bad-lines` passes over bad lines in both. Reading keeps sums (hit-rate) or a
few numbers per request (simulate), never the records or their tokens."""
from __future__ import annotations

import json
import math
import random
import sys
import tracemalloc
from pathlib import Path

import pytest

from uniradix.bench import log_records, simulate
from uniradix.cli import main

START = {"time": 1.0, "event": "start", "settings": {"model_preset": "tiny-hybrid", "max_total_tokens": 4096,
                                                     "vocab_size": 256}}


def _req(**kw) -> dict:
    """A good request line, as `uniradix serve --request-log --log-token-ids` writes it."""
    return {"time": 10.0, "rid": "r1", "session": "s", "status": "finished", "finish_reason": "length",
            "prompt_tokens": 3, "cached_tokens": 0, "cached_device": 0, "cached_host": 0, "cached_storage": 0,
            "computed_tokens": 3, "output_tokens": 1, "ttft": 0.5, "latency": 1.0, "input_ids": [1, 2, 3],
            "output_ids": [4], "salt": None, "priority": None, "prompt_logprobs_from": None, **kw}


def _j(rec) -> bytes:
    return json.dumps(rec).encode() + b"\n"


def _start(**settings) -> bytes:
    return _j({**START, "settings": {**START["settings"], **settings}})


def _close(**kw) -> bytes:
    return _j({"time": 11.0, "event": "close_session", "session": "s", "salt": None, **kw})


GOOD = _j(_req())
DEEP = b"[" * 5000 + b"]" * 5000

#: name -> (the log's bytes, the bad line's number, the field named (None: the line as a whole))
HOSTILE = {
    # ids
    "an input id past the vocabulary": (_start() + _j(_req(input_ids=[1, 256, 3])), 2, "input_ids"),
    "an output id past the vocabulary": (_start() + _j(_req(output_ids=[10 ** 6])), 2, "output_ids"),
    "a huge id": (_start() + _j(_req(input_ids=[1, 10 ** 30, 3])), 2, "input_ids"),
    "a negative id": (_start() + _j(_req(input_ids=[1, -2, 3])), 2, "input_ids"),
    "a float id": (_start() + _j(_req(input_ids=[1.0, 2.0, 3.0])), 2, "input_ids"),
    "a boolean id": (_start() + _j(_req(input_ids=[1, True, 3])), 2, "input_ids"),
    "ids as a string": (_start() + _j(_req(input_ids="1 2 3")), 2, "input_ids"),
    "an empty prompt": (_start() + _j(_req(input_ids=[], prompt_tokens=0)), 2, "input_ids"),
    "a finished request without output": (_start() + _j(_req(output_ids=[], output_tokens=0)), 2, "output_ids"),
    # sessions, salts, priorities, ids of requests
    "a session that is a list": (_start() + _j(_req(session=[1, 2])), 2, "session"),
    "a session that is an object": (_start() + _j(_req(session={"a": 1})), 2, "session"),
    "a session that is a float": (_start() + _j(_req(session=1.5)), 2, "session"),
    "a session that is a boolean": (_start() + _j(_req(session=True)), 2, "session"),
    "a salt that is a list": (_start() + _j(_req(salt=["x"])), 2, "salt"),
    "a string priority": (_start() + _j(_req(priority="high")), 2, "priority"),
    "a float priority": (_start() + _j(_req(priority=1.5)), 2, "priority"),
    "a priority past 64 bits": (_start() + _j(_req(priority=2 ** 70)), 2, "priority"),
    "a rid that is an object": (_start() + _j(_req(rid={"a": 1})), 2, "rid"),
    "a status that is a list": (_start() + _j(_req(status=["finished"])), 2, "status"),
    "a finish reason that is a number": (_start() + _j(_req(finish_reason=3)), 2, "finish_reason"),
    # times
    "a negative time": (_start() + _j(_req(time=-5.0)), 2, "time"),
    "a NaN time": (_start() + b'{"time": NaN, "prompt_tokens": 3, "cached_tokens": 0}\n', 2, "time"),
    "an infinite time": (_start() + b'{"time": Infinity, "prompt_tokens": 3, "cached_tokens": 0}\n', 2, "time"),
    "a time past year 9999": (_start() + _j(_req(time=1e300)), 2, "time"),
    "a time that is a string": (_start() + _j(_req(time="now")), 2, "time"),
    "a negative latency": (_start() + _j(_req(latency=-100.0)), 2, "latency"),
    "a latency that is a string": (_start() + _j(_req(latency="1s")), 2, "latency"),
    "a NaN ttft": (_start() + b'{"ttft": NaN, "prompt_tokens": 3, "cached_tokens": 0}\n', 2, "ttft"),
    "an arrival after the finish": (_start() + _j(_req(arrival=20.0)), 2, "arrival"),
    # counts
    "a prompt count that is a string": (_start() + _j(_req(prompt_tokens="3")), 2, "prompt_tokens"),
    "a prompt count that is a boolean": (_start() + _j(_req(prompt_tokens=True)), 2, "prompt_tokens"),
    "a negative cached count": (_start() + _j(_req(cached_tokens=-1)), 2, "cached_tokens"),
    "an infinite count": (_start() + b'{"prompt_tokens": 1e400, "cached_tokens": 0}\n', 2, "prompt_tokens"),
    "more cached than prompt": (_start() + _j(_req(cached_tokens=4)), 2, "cached_tokens"),
    "a tier past the cached count": (_start() + _j(_req(cached_host=2)), 2, "cached_host"),
    "a prompt count the ids deny": (_start() + _j(_req(prompt_tokens=5)), 2, "prompt_tokens"),
    "an output count the ids deny": (_start() + _j(_req(output_tokens=2)), 2, "output_tokens"),
    "a round that is a list": (_start() + _j(_req(round=[1])), 2, "round"),
    "a string prompt_logprobs_from": (_start() + _j(_req(prompt_logprobs_from="0")), 2, "prompt_logprobs_from"),
    "prompt logprobs past the prompt": (_start() + _j(_req(prompt_logprobs_from=3)), 2, "prompt_logprobs_from"),
    # start lines
    "settings that are a list": (_j({**START, "settings": [1, 2]}) + GOOD, 1, "settings"),
    "no settings": (_j({"time": 1.0, "event": "start"}) + GOOD, 1, "settings"),
    "a string page size": (_start(page_size="x") + GOOD, 1, "settings.page_size"),
    "a negative page size": (_start(page_size=-1) + GOOD, 1, "settings.page_size"),
    "a pool size that is a float": (_start(max_total_tokens=1.5) + GOOD, 1, "settings.max_total_tokens"),
    "an unknown eviction policy": (_start(radix_eviction_policy="newest") + GOOD, 1,
                                   "settings.radix_eviction_policy"),
    "a NaN host ratio": (_start().replace(b'"vocab_size"', b'"hicache_ratio": NaN, "vocab_size"') + GOOD, 1,
                         "settings.hicache_ratio"),
    "a preset that is a list": (_start(model_preset=["tiny-hybrid"]) + GOOD, 1, "settings.model_preset"),
    "a dtype that is not one": (_start(dtype="nn") + GOOD, 1, "settings.dtype"),
    "a boolean that is a number": (_start(enable_hierarchical_cache=1) + GOOD, 1,
                                   "settings.enable_hierarchical_cache"),
    "a zero vocabulary": (_start(vocab_size=0) + GOOD, 1, "settings.vocab_size"),
    "a start line's time that is a string": (_j({**START, "time": "x"}) + GOOD, 1, "time"),
    # close_session lines and other events
    "a closed session that is a list": (_start() + GOOD + _close(session=[1]), 3, "session"),
    "a close without a session": (_start() + GOOD + _close(session=None), 3, "session"),
    "a close without a time": (_start() + GOOD + _close(time=None), 3, "time"),
    "a close whose time is a string": (_start() + GOOD + _close(time="later"), 3, "time"),
    "a close whose salt is an object": (_start() + GOOD + _close(salt={"a": 1}), 3, "salt"),
    "an event that is a number": (_start() + GOOD + _j({"time": 1.0, "event": 7}), 3, "event"),
    # the text
    "deep nesting": (_start() + DEEP + b"\n" + GOOD, 2, None),
    "deep nesting in a field": (_start() + _j(_req())[:-2] + b', "extra": ' + DEEP + b"}\n", 2, "extra"),
    "bytes that are not UTF-8": (_start() + _j(_req(rid="RID"))[:-1].replace(b"RID", b"\xff\xfe") + b"\n", 2,
                                 "rid"),
    "a NUL line": (_start() + b"\x00\x00\x00\n" + GOOD, 2, None),
    "an empty line": (_start() + b"\n" + GOOD, 2, None),
    "a blank line": (_start() + GOOD + b"   \t \n" + GOOD, 3, None),
    "a truncated last line": (_start() + GOOD + GOOD[:40], 3, None),
    "not JSON": (_start() + b"time=10 prompt=3\n" + GOOD, 2, None),
    "a JSON array": (_start() + b"[1, 2, 3]\n" + GOOD, 2, None),
    "a JSON string": (_start() + b'"finished"\n' + GOOD, 2, None),
    "a number of 5000 digits": (_start() + b'{"prompt_tokens": ' + b"9" * 5000 + b', "cached_tokens": 0}\n', 2,
                                None),
}
TOOLS = {"hit-rate": [], "simulate": ["--model-preset", "tiny-hybrid"]}


def _run(capsys, tool: str, log: Path, *more) -> tuple[int, str, str]:
    rc = main([tool, str(log), *TOOLS[tool], *more])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_line_is_one_line_naming_line_and_field(tmp_path, capsys, tool, case):
    data, line, field = HOSTILE[case]
    log = tmp_path / "log.jsonl"
    log.write_bytes(data)
    rc, _, err = _run(capsys, tool, log)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, (rc, err)
    assert "Traceback" not in err and lines[0].startswith(f"uniradix {tool}: {log} "), err
    assert f" line {line}: " + (f"{field}: " if field else "") in lines[0], err


def test_a_line_longer_than_the_bound_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(log_records, "MAX_LINE_BYTES", 4096)
    log = tmp_path / "log.jsonl"
    log.write_bytes(_start() + _j(_req(input_ids=[1] * 3000, prompt_tokens=3000)) + GOOD)
    for tool in TOOLS:
        rc, _, err = _run(capsys, tool, log)
        assert rc == 2 and err == f"uniradix {tool}: {log} line 2: longer than 4,096 bytes\n", err


def test_skipping_bad_lines_keeps_the_good_ones_in_both_tools(tmp_path, capsys):
    """Every hostile line of the table between good requests: with --skip-bad-lines
    each tool says each bad line (the first ten, then a count) and counts exactly the
    good requests; without it, both stop at the first."""
    rng = random.Random(1)
    good, bad, body = [], 0, [_start()]
    for name, (data, line, _) in HOSTILE.items():
        if name.startswith(("a truncated", "settings", "no settings")) or line == 1:
            continue  # a start line of the log's own, and a cut short line only at the end
        bad_line = data.split(b"\n")[line - 1] + b"\n" if line <= data.count(b"\n") else data
        ids = [rng.randrange(256) for _ in range(rng.randrange(3, 20))]
        rec = _req(input_ids=ids, prompt_tokens=len(ids), cached_tokens=1, cached_device=1,
                   session=f"s{len(good) % 3}", time=10.0 + len(good), latency=0.5, rid=f"r{len(good)}")
        good.append(rec)
        body += [_j(rec), bad_line]
        bad += 1
    log = tmp_path / "log.jsonl"
    log.write_bytes(b"".join(body))
    prompt = sum(r["prompt_tokens"] for r in good)
    rc, out, err = _run(capsys, "hit-rate", log, "--skip-bad-lines")
    assert rc == 0 and f"all: {len(good):,} requests, {len(good):,} of {prompt:,} prompt tokens" in out, out + err
    assert err.count("(skipped)") == 10 and f"{bad} bad line(s) skipped ({bad - 10} not shown)" in err, err
    rc, out, err = _run(capsys, "simulate", log, "--skip-bad-lines")
    assert rc == 0 and f"{len(good):,} requests ({prompt:,} prompt tokens)" in out, out + err
    assert f"{bad} bad line(s) skipped" in err and "Traceback" not in err, err
    for tool in TOOLS:
        rc, _, err = _run(capsys, tool, log)
        assert rc == 2 and " line 3: " in err and err.count("\n") == 1, err


def test_standard_input_is_read_by_both_tools(capsys, monkeypatch):
    import io
    for tool, said in (("hit-rate", "all: 1 requests"), ("simulate", "1 requests (3 prompt tokens)")):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(_start() + GOOD + _close())))
        rc, out, err = _run(capsys, tool, Path("-"))
        assert rc == 0 and said in out, out + err


# ---------------------------------------------------------------------------- memory
def _plain_log(path: Path, lines: int, seed: int = 0) -> None:
    """Request lines without token ids over a fixed set of groups (8 rounds, 40
    sessions, 24 hours): more lines, the same groups."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        f.write(json.dumps(START) + "\n")
        for i in range(lines):
            p = rng.randrange(10, 2000)
            f.write(json.dumps({"time": 1796228643.0 + (i % 24) * 3600 + rng.random(), "round": i % 8,
                                "session": f"s{i % 40}", "rid": f"{i:08x}", "status": "finished",
                                "prompt_tokens": p, "cached_tokens": rng.randrange(p), "cached_device": 0,
                                "cached_host": 0, "cached_storage": 0, "latency": 0.5}) + "\n")


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_hit_rate_keeps_sums_per_group_not_records(tmp_path, capsys):
    """Ten times the lines over the same groups: the same memory (sums per group)."""
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    _plain_log(small, 2_000)
    _plain_log(big, 20_000)
    peaks = []
    for log in (small, big):
        peaks.append(_peak(lambda log=log: main(["hit-rate", str(log)])))
        out = capsys.readouterr().out
        assert "all: " in out and "session" in out
    assert peaks[1] < 1.5 * peaks[0] + 256 * 1024, peaks  # records kept: ten times as much


def test_simulate_keeps_a_few_numbers_per_request_not_its_tokens(tmp_path):
    """Reading a log keeps where each request's line is and its times; the tokens are
    read back when the replay submits the request."""
    rng = random.Random(2)
    log = tmp_path / "log.jsonl"
    n, tokens = 1_000, 1_000
    with open(log, "w") as f:
        f.write(json.dumps(START) + "\n")
        for i in range(n):
            ids = [rng.randrange(256) for _ in range(tokens)]
            f.write(json.dumps(_req(input_ids=ids, prompt_tokens=tokens, time=10.0 + i, session=f"s{i % 7}",
                                    rid=str(i))) + "\n")
    traffic = []
    peak = _peak(lambda: traffic.append(simulate.read_log(str(log))))
    # the ids alone, held as lists, are 8 bytes a token: 8 MB here
    assert peak < 2 * 1024 * 1024, peak
    traffic = traffic[0]
    assert len(traffic.requests) == n and traffic.prompt_tokens == n * tokens
    r = traffic.requests[n // 2]  # read back from its line, checked again
    assert len(r.input_ids) == tokens and r.output_ids == [4] and r.round == n // 2 // 7 + 1


def test_a_request_line_changed_under_the_replay_is_one_line(tmp_path, capsys):
    """The replay reads each request's line again: a log rewritten between the passes
    is said as a bad line, not replayed as something else."""
    log = tmp_path / "log.jsonl"
    log.write_bytes(_start() + GOOD)
    traffic = simulate.read_log(str(log), 256)
    log.write_bytes(_start() + _j(_req(input_ids=[1, 2, 300])))
    with pytest.raises(log_records.BadRecord, match="line 2: input_ids: token id 300"):
        traffic.requests[0]


@pytest.mark.slow
def test_a_million_line_log_in_bounded_memory(tmp_path):
    """A 10^6-line log (benchmarks/request_log_gen.py): hit-rate's peak RSS and
    simulate's reading stay bounded (no timing verdict). The figures in docs/tools.md come
    from benchmarks/log_tools.py."""
    import subprocess
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import request_log_gen
    log = tmp_path / "big.jsonl"
    request_log_gen.write(str(log), 1_000_000)
    code = ("import resource, sys; from uniradix.cli import main; rc = main(['hit-rate', sys.argv[1]]); "
            "print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, timeout=3600,
                         check=False)
    assert out.returncode == 0 and "all: " in out.stdout, out.stderr
    rss_kb = int(out.stderr.split("maxrss ")[1].split()[0])
    assert rss_kb < 1024 * 1024, rss_kb  # the imports (torch) and sums per session: far below a GB
    traffic = []
    peak = _peak(lambda: traffic.append(simulate.read_log(str(log), 256)))
    n = len(traffic[0].requests)
    assert n > 700_000 and peak < 400 * n, (n, peak)  # bytes per request, whatever its tokens (~45 ids)
    assert not math.isnan(traffic[0].requests.arrival[-1])
