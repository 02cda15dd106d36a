"""SGLang's own clients against the server, by the bodies they send (fixtures: captured
from bench_serving, bench_multiturn's payload, the gateway's fields): every field of
SGLang's request is either used, ignored (no effect here) or refused with a 400 naming
it when it asks for what is not implemented; names SGLang does not know either are
ignored with one warning each. SGLang's cache partitions (`cache_salt`, `extra_key`)
and vLLM's `cache_salt` keep requests from reusing each other's prefixes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_proc import ServerProc

from uniradix.server.compat import (GENERATE_IGNORED, GENERATE_NEUTRAL, GENERATE_USED, SAMPLING_IGNORED,
                                    SAMPLING_NEUTRAL, SAMPLING_USED, UnknownFields, neutral)

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "sglang_clients.json").read_text())
CLIENTS = [k for k in FIXTURES if not k.startswith("_")]

#: SGLang 0.5.23's GenerateReqInput and SamplingParams fields (python/sglang/srt/managers/io_struct.py,
#: srt/sampling/sampling_params.py), read from the installed package
SGLANG_GENERATE = (
    "rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes mm_content_hashes "
    "use_audio_in_video video_config sampling_params watermark return_logprob logprob_start_len top_logprobs_num "
    "token_ids_logprob return_sampling_mask sampling_logprobs_mode return_text_in_logprobs "
    "return_flat_raw_top_logprobs return_flat_raw_output_top_logprobs return_flat_raw_top_logprobs_b64 stream "
    "log_metrics return_hidden_states return_routed_experts routed_experts_start_len return_indexer_topk modalities "
    "session_params lora_path lora_id custom_logit_processor positional_embed_overrides bootstrap_host "
    "bootstrap_port bootstrap_room bootstrap_pair_key decode_tp_size routed_dp_rank data_parallel_rank "
    "disagg_prefill_dp_rank routing_key conversation_id http_worker_ipc background require_reasoning "
    "max_thinking_tokens priority extra_key no_logs custom_labels return_bytes return_entropy "
    "return_prompt_token_ids external_trace_header received_time need_wait_for_mm_inputs num_items_assigned "
    "encoder_urls max_dynamic_patch min_dynamic_patch image_max_dynamic_patch video_max_dynamic_patch images_config "
    "mm_processor_kwargs multi_item_delimiter_indices token_indices_to_pool cache_salt kv_hints").split()
SGLANG_SAMPLING = (
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty presence_penalty "
    "repetition_penalty min_new_tokens n beam_width json_schema regex ebnf structural_tag ignore_eos "
    "skip_special_tokens spaces_between_special_tokens no_stop_trim stream_interval logit_bias sampling_seed "
    "custom_params watermark stop_strs stop_regex_strs stop_str_max_len stop_regex_max_len is_normalized "
    "ebnf_full_assistant").split()


def test_every_sglang_field_has_one_place():
    """Each field of SGLang's request and sampling parameters is used, ignored or
    neutral-only: exactly one (a field in none would be warned about as unknown)."""
    for names, tables in ((SGLANG_GENERATE, (GENERATE_USED, GENERATE_IGNORED, set(GENERATE_NEUTRAL))),
                          (SGLANG_SAMPLING, (SAMPLING_USED, SAMPLING_IGNORED, set(SAMPLING_NEUTRAL)))):
        for name in names:
            assert sum(name in t for t in tables) == 1, name


def test_neutral_values():
    assert neutral(None, (None, "", [])) and neutral("", (None, "", [])) and neutral([None, ""], (None, "", []))
    assert not neutral("adapter", (None, "", [])) and not neutral([None, "a"], (None, "", []))
    assert neutral(False, (False, None)) and not neutral(0, (False, None)) and not neutral(True, (1, 1.0, None))
    assert neutral(1.0, (1, 1.0, None)) and neutral({}, (None, {})) and not neutral({"5": 1}, (None, {}))


def test_unknown_names_are_logged_once_each(caplog):
    u = UnknownFields()
    with caplog.at_level("WARNING", logger="uniradix.server"):
        for _ in range(3):
            u.note("/generate", {"foo", "bar"})
        u.note("/other", {"foo"})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and sum("'foo'" in m for m in lines) == 2, lines


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--max-total-tokens", "4096")
    yield s
    assert s.stop() == 0, "".join(s.lines[-30:])


def _generate(server, body):
    """POST /generate; a streamed answer is read to its end: (status, the last chunk)."""
    if not body.get("stream"):
        status, out, _ = server.post("/generate", body)
        return status, out
    events = list(server.stream("/generate", body))  # asserts the 200
    assert events[-1] == "[DONE]", events[-3:]
    return 200, events[-2]


@pytest.mark.parametrize("client", CLIENTS)
def test_sglang_clients_bodies_are_served(server, client):
    body = json.loads(json.dumps(FIXTURES[client]))
    if "messages" in body:  # what the gateway forwards of a chat request
        status, out, _ = server.post("/v1/chat/completions", body)
        assert status == 200 and out["usage"]["completion_tokens"] >= 1, out
        return
    status, out = _generate(server, body)
    assert status == 200, out
    assert out["meta_info"]["completion_tokens"] == body["sampling_params"]["max_new_tokens"] or \
        out["meta_info"]["finish_reason"]["type"] == "stop", out


def test_unknown_fields_are_ignored_with_one_warning_each(server):
    body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 2, "temperature": 0, "zz_knob": 1},
            "zz_field_from_the_future": {"a": 1}}
    for _ in range(3):
        status, out, _ = server.post("/generate", body)
        assert status == 200, out
    log = "".join(server.lines)
    assert log.count("'zz_field_from_the_future'") == 1 and log.count("'zz_knob'") == 1, log[-2000:]


def test_cache_salts_partition_reuse(server):
    """The same prompt under another cache_salt (or extra_key; vLLM's cache_salt on the
    OpenAI routes) reuses nothing of the first; under the same salt it reuses."""
    prompt = "A prompt long enough to be cached in pages: " + "lorem ipsum dolor sit amet " * 12
    sp = {"max_new_tokens": 1, "temperature": 0}

    def cached(**fields):
        status, out, _ = server.post("/generate", {"text": prompt, "sampling_params": sp, **fields})
        assert status == 200, out
        return out["meta_info"]["cached_tokens"]

    cached(cache_salt="tenant-a")
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached(extra_key="tenant-a") == 0           # another partition than cache_salt="tenant-a"
    assert cached(extra_key="k", cache_salt="tenant-a") == 0
    assert cached(extra_key="k", cache_salt="tenant-a") > 0
    cached()                                           # the prompt under no salt
    assert cached(cache_salt="") > 0                   # an empty salt is none, as SGLang reads it
    status, out, _ = server.post("/v1/completions", {"model": "tiny-hybrid", "prompt": prompt, "max_tokens": 1,
                                                     "cache_salt": "tenant-c"})
    assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, out
    status, out, _ = server.post("/v1/completions", {"model": "tiny-hybrid", "prompt": prompt, "max_tokens": 1,
                                                     "cache_salt": "tenant-c"})
    assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, out


def test_a_batch_rid_prefixes_each_prompt(server):
    status, out, _ = server.post("/generate", {"text": ["one", "two"], "rid": "job",
                                               "sampling_params": {"max_new_tokens": 1}})
    assert status == 200, out
    assert [o["meta_info"]["id"] for o in out] == ["job_0", "job_1"], out
