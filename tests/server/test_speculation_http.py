"""Speculative decoding over HTTP: `uniradix serve --speculative-algorithm NGRAM+SUFFIX`
answers SGLang's /generate and OpenAI's routes with the replies of the cache-off engine
(greedy), streams several tokens a step, reports its verify steps in meta_info and its
drafts on /metrics as vLLM names them; vLLM's --speculative-config form starts it too."""
import pytest

from server_proc import ServerProc
from uniradix.engine import Engine


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--max-total-tokens", "4096", "--speculative-algorithm", "NGRAM+SUFFIX",
                   "--speculative-num-draft-tokens", "4")
    yield s
    assert s.stop() == 0, "".join(s.lines[-30:])


@pytest.fixture(scope="module")
def oracle():
    eng = Engine("tiny-hybrid", disable_radix_cache=True, max_total_tokens=4096)
    return lambda ids, n: eng.generate(input_ids=list(ids), max_new_tokens=n).output_ids


def test_replies_are_the_cache_off_engines_and_say_their_drafts(server, oracle):
    # runs of numbers the prompt lookup drafts from, the same run twice
    ids = list(range(1, 60)) + list(range(20, 50))
    s, r, _ = server.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0}})
    assert s == 200, r
    assert r["output_ids"] == oracle(ids, 24)
    meta = r["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_draft_tokens"] >= meta["spec_accepted_tokens"] >= 0
    # SGLang's newer names for the same figures
    kept, drafted, verifies = meta["spec_accepted_tokens"], meta["spec_draft_tokens"], meta["spec_verify_ct"]
    assert (meta["spec_accept_token_num"], meta["spec_draft_token_num"]) == (kept, drafted)
    assert meta["spec_accept_rate"] == kept / drafted and meta["spec_accept_length"] == (kept + verifies) / verifies
    # the same prompt again: the reply is cached, and the cache drafts it
    s, again, _ = server.post("/generate", {"input_ids": ids + r["output_ids"][:4],
                                            "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    assert s == 200 and again["output_ids"] == r["output_ids"][4:20]
    assert again["meta_info"]["spec_accepted_tokens"] > 0
    m = server.metrics()
    assert m["uniradix_spec_decode_num_drafts_total"] >= meta["spec_verify_ct"] + again["meta_info"]["spec_verify_ct"]
    assert m["uniradix_spec_decode_num_accepted_tokens_total"] >= again["meta_info"]["spec_accepted_tokens"]
    assert sum(v for k, v in m.items() if k.startswith("uniradix_spec_decode_num_accepted_tokens_per_pos_total")) \
        == m["uniradix_spec_decode_num_accepted_tokens_total"]
    assert m["uniradix_spec_decode_drafts_cut_total"] == 0  # the pools had room for every draft
    # the server's tokens a verify step, where SGLang's bench_serving reads its accept length
    s, info, _ = server.get("/get_server_info")
    verifies = m["uniradix_spec_decode_num_drafts_total"]
    assert info["internal_states"] == [{"avg_spec_accept_length": pytest.approx(
        (m["uniradix_spec_decode_num_accepted_tokens_total"] + verifies) / verifies)}]


def test_a_stream_carries_what_a_step_kept_and_openai_completions_work(server, oracle):
    ids = list(range(1, 60)) + list(range(20, 50))
    events = list(server.stream("/generate", {"input_ids": ids + [7], "stream": True,
                                              "sampling_params": {"max_new_tokens": 20, "temperature": 0}}))
    last = [e for e in events if isinstance(e, dict)][-1]
    assert last["output_ids"] == oracle(ids + [7], 20)
    s, r, _ = server.post("/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0})
    assert s == 200 and r["usage"]["completion_tokens"] == 12, r
    # the drafts as OpenAI counts a predicted output's: the same prompt again, so the
    # cache drafts what the first reply said and the verifies keep it
    s, again, _ = server.post("/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0})
    assert s == 200 and again["choices"][0]["text"] == r["choices"][0]["text"]
    details = again["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] >= 0


def test_usage_counts_drafts_as_predicted_outputs_only_where_speculation_ran():
    """usage's completion_tokens_details: the drafts kept and rejected, summed over the
    choices (meta_info's spec_accepted_tokens, and spec_draft_tokens less them); absent
    where no verify ran, so a server without speculation answers as before."""
    from types import SimpleNamespace as NS
    from uniradix.server.jobs import usage

    def req(out, verifies, drafted, kept):
        m = NS(prompt_tokens=10, cached_tokens=4, spec_verify_ct=verifies, spec_draft_tokens=drafted,
               spec_accepted_tokens=kept)
        return NS(metrics=m, output_ids=[1] * out)
    u = usage([req(6, 2, 8, 5), req(4, 1, 4, 0)])
    assert u["completion_tokens"] == 10 and u["prompt_tokens_details"] == {"cached_tokens": 8}
    assert u["completion_tokens_details"] == {"accepted_prediction_tokens": 5, "rejected_prediction_tokens": 7}
    assert "completion_tokens_details" not in usage([req(6, 0, 0, 0)])


def test_vllms_form_starts_a_speculating_server():
    s = ServerProc("--max-total-tokens", "1024", "--speculative-config",
                   '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    try:
        code, info, _ = s.get("/get_server_info")
        assert code == 200
        assert info["speculative_algorithm"] == "NGRAM" and info["speculative_num_draft_tokens"] == 3
        assert info["speculative_ngram_max_match_window_size"] == 4
    finally:
        assert s.stop() == 0
