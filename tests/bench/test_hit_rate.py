"""`--request-log` and `uniradix hit-rate`: the server writes one JSON line per finished
request; the command sums cached over prompt tokens per round, hour and session (never
a mean of per-request ratios) and agrees with what the responses said."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from uniradix.cli import main  # noqa: E402


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n")


def test_summed_not_averaged(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    _write(log, [{"round": 1, "prompt_tokens": 10, "cached_tokens": 0, "session": "a", "time": 0},
                 {"round": 1, "prompt_tokens": 1000, "cached_tokens": 900, "session": "b", "time": 3600},
                 {"round": 2, "prompt_tok": 100, "cached_tok": 50, "session": "a", "time": 3601}])
    assert main(["hit-rate", str(log)]) == 2  # the last line is not JSON: stops there, naming it
    assert "log.jsonl line 4: not JSON" in capsys.readouterr().err
    assert main(["hit-rate", str(log), "--skip-bad-lines"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "950 of 1,110 prompt tokens cached: hit rate 85.6%" in out          # a mean of ratios: 48.3%
    lines = out.splitlines()
    round1 = next(line for line in lines if line.startswith("1 "))
    assert "1,010" in round1 and "89.1%" in round1, round1
    assert any(line.startswith("1970-01-01 01:00") and "86.4%" in line for line in lines), out
    sess_a = next(line for line in lines if line.startswith("a "))
    assert "110" in sess_a and "45.5%" in sess_a, sess_a
    assert "line 4: not JSON" in captured.err and "1 bad line(s) skipped" in captured.err


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["hit-rate", str(tmp_path / "absent.jsonl")]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"x": 1}\n')
    assert main(["hit-rate", str(empty)]) == 1
    assert main(["hit-rate", str(empty), "--by", "day"]) in (1, 2)
    err = capsys.readouterr().err
    assert "absent.jsonl" in err and "no record" in err


def test_the_server_log_agrees_with_the_responses(tmp_path, capsys):
    from server_proc import ServerProc
    log = tmp_path / "requests.jsonl"
    s = ServerProc("--max-total-tokens", "4096", "--request-log", str(log))
    prompt, cached = 0, 0
    try:
        base = "a conversation that grows turn by turn, " * 3
        for turn in range(3):
            for sid in ("s1", "s2"):
                status, out, _ = s.post("/generate", {"text": base + f"{sid} turn {turn} " * (turn + 1),
                                                      "sampling_params": {"max_new_tokens": 3}, "session_id": sid,
                                                      "rid": f"{sid}-{turn}"})
                assert status == 200, out
                prompt += out["meta_info"]["prompt_tokens"]
                cached += out["meta_info"]["cached_tokens"]
    finally:
        assert s.stop() == 0, "".join(s.lines[-30:])
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0]["event"] == "start" and lines[0]["settings"]["max_total_tokens"] == 4096
    assert lines[0]["settings"]["vocab_size"] == 256  # what the tools check the ids against
    records = [r for r in lines if "event" not in r]
    assert len(records) == 6 and {r["rid"] for r in records} == {f"s{i}-{t}" for i in (1, 2) for t in range(3)}
    r = records[-1]
    assert r["session"] in ("s1", "s2") and r["status"] == "finished" and r["ttft"] > 0
    assert r["cached_device"] + r["cached_host"] + r["cached_storage"] == r["cached_tokens"]
    assert "text" not in r and "prompt" not in r and "input_ids" not in r  # token ids only when asked
    assert main(["hit-rate", str(log), "--by", "session"]) == 0
    out = capsys.readouterr().out
    assert f"{cached:,} of {prompt:,} prompt tokens cached" in out and cached > 0, out
    assert any(line.startswith("s1 ") for line in out.splitlines()), out


def test_a_log_path_it_cannot_write_is_a_start_up_error(tmp_path):
    import subprocess
    out = subprocess.run([sys.executable, "-m", "uniradix.cli", "serve", "--port", "0", "--request-log",
                          str(tmp_path / "no" / "such" / "dir" / "log.jsonl")], capture_output=True, text=True,
                         timeout=600)   # a guard against a hang: a loaded machine starts Python slowly
    assert out.returncode == 2 and "--request-log" in out.stderr and "Traceback" not in out.stderr, out.stderr
