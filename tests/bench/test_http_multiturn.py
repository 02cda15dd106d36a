"""`uniradix bench multiturn --url`: the multi-turn client against a running server,
through SGLang's API and OpenAI's: every request served, the hit rate read from the
responses (reuse from round 2 on), one JSON line per request that `uniradix hit-rate`
reads back to the same totals, and "not reported" where a server gives no count."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from uniradix.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def server():
    from server_proc import ServerProc
    s = ServerProc("--max-total-tokens", "16384", "--max-running-requests", "8")
    yield s
    assert s.stop() == 0, "".join(s.lines[-30:])


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_against_uniradix_serve(server, api, tmp_path, capsys):
    log = tmp_path / "bench.jsonl"
    code = main(["bench", "multiturn", "--url", f"http://127.0.0.1:{server.port}", "--api", api,
                 "--model", "tiny-hybrid", "--clients", "3", "--rounds", "3", "--preamble-words", "20",
                 "--document-words", "30", "--new-words", "8", "--output-tokens", "4", "--no-progress",
                 "--log", str(log), "--seed", "7" if api == "sglang" else "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    assert all(r[-1] == "0" for r in rows), out                     # no errors
    assert all(float(r[3].rstrip("%")) > 0 for r in rows[1:]), out   # round 2 on resumes where round 1 stopped
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 9 and {r["round"] for r in records} == {1, 2, 3}
    prompt, cached = sum(r["prompt_tokens"] for r in records), sum(r["cached_tokens"] for r in records)
    assert main(["hit-rate", str(log), "--by", "round"]) == 0
    assert f"{cached:,} of {prompt:,} prompt tokens cached" in capsys.readouterr().out


def test_not_reported_and_bad_flags(tmp_path, capsys):
    from uniradix.bench.http_multiturn import Result, _print, _summary

    class A:
        url, api, clients, rounds, new_words, output_tokens, session_id = "http://x", "openai", 1, 1, 1, 1, False
    rows = [_summary(1, [Result(0, 1, prompt_tokens=10, ttft=0.1)], 1.0)]
    _print(rows, A, sys.stdout)
    out = capsys.readouterr().out
    assert "not reported" in out and "0.0%" not in out, out
    assert main(["bench", "multiturn", "--url", "ftp://127.0.0.1:1", "--no-progress"]) == 2
    assert main(["bench", "multiturn", "--url", "http://127.0.0.1:1", "--clients", "0"]) == 2


def test_tier_split_is_summed_and_a_stream_error_event_is_a_failed_request(server, capsys):
    """A uniradix server's per-tier split is summed per round; an error event in a
    stream (what SGLang's gateway sends when the worker behind it died) fails the
    request instead of passing for an empty reply."""
    import threading
    from argparse import Namespace
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from uniradix.bench import http_multiturn as hm
    a = Namespace(url=f"http://127.0.0.1:{server.port}", api="sglang", model="m", api_key=None, clients=2, rounds=2,
                  preamble_words=10, document_words=10, new_words=4, output_tokens=3, max_parallel=2,
                  request_rate=0.0, session_id=True, routing_key=False, seed=3, timeout=600.0, log=None, plot=None,
                  no_progress=True)
    rows = hm.run(a)
    assert all(r["cached_by_tier"] is not None for r in rows)
    assert all(sum(r["cached_by_tier"][t] for t in ("device", "host", "storage")) == r["cached_tokens"] for r in rows)
    assert "by tier: device" in capsys.readouterr().out

    class Dying(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"text": "a", "meta_info": {"prompt_tokens": 5}}\n\n'
                             b'data: {"error": {"message": "Stream error: unexpected EOF", "type": "stream_error"}}\n\n'
                             b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Dying)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        res = hm.one_request(Namespace(**{**vars(a), "url": f"http://127.0.0.1:{httpd.server_port}"}),
                             hm.Conversation("x"), 0, 1)
    finally:
        httpd.shutdown()
    assert res.error is not None and "unexpected EOF" in res.error
