"""What SGLang's clients send, field by field: every field of SGLang's own `/generate`
request (`GenerateReqInput`) and of its `sampling_params`, sorted by what this server
does with it, so that SGLang's bench_serving, its multi-turn benchmark and its gateway
work unchanged, and no field's meaning is dropped silently:

- used: read by protocol.py (the prompt, sampling, streaming, ids, sessions, salts);
- ignored: changes nothing in the answer here, whatever its value (routing hints for
  SGLang's own data-parallel and disaggregated deployments, logging and metric labels,
  tracing, multimodal tiling knobs that do nothing without an image);
- neutral only: would change the answer (or what comes back) if honoured, and is not
  implemented: accepted at its neutral value (the one SGLang's clients send by
  default), a 400 naming the field otherwise;
- unknown to SGLang too: ignored with one warning per name, as SGLang and vLLM do.

The field lists are SGLang 0.5.23's (python/sglang/srt/managers/io_struct.py and
srt/sampling/sampling_params.py)."""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("uniradix.server")

#: /generate fields protocol.parse_generate reads
GENERATE_USED = frozenset({
    "text", "input_ids", "sampling_params", "rid", "stream", "session_id", "session_params", "priority",
    "cache_salt", "extra_key", "return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
    "modalities"})

#: /generate fields that change nothing here, whatever their value
GENERATE_IGNORED = frozenset({
    "log_metrics", "no_logs", "custom_labels", "background", "model",
    "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", "routing_key", "conversation_id",
    "http_worker_ipc", "kv_hints", "kv_router_hint",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
    "external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
    "use_audio_in_video", "video_config", "mm_hashes", "mm_content_hashes", "max_dynamic_patch",
    "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "lora_id", "return_bytes", "routed_experts_start_len"})

#: /generate fields accepted at these values only: what they ask for is not implemented
GENERATE_NEUTRAL = {
    "input_embeds": (None,), "image_data": (None, []), "video_data": (None, []), "audio_data": (None, []),
    "lora_path": (None, "", []), "custom_logit_processor": (None, ""), "positional_embed_overrides": (None,),
    "return_hidden_states": (False, None), "return_routed_experts": (False, None),
    "return_indexer_topk": (False, None), "return_entropy": (False, None), "return_prompt_token_ids": (False, None),
    "return_sampling_mask": (False, None), "sampling_logprobs_mode": (None,), "token_ids_logprob": (None, []),
    "return_flat_raw_top_logprobs": (False, None), "return_flat_raw_output_top_logprobs": (False, None),
    "return_flat_raw_top_logprobs_b64": (False, None), "watermark": (None,), "require_reasoning": (False, None),
    "max_thinking_tokens": (None,), "multi_item_delimiter_indices": (None,), "token_indices_to_pool": (None,)}

#: sampling_params fields protocol.sampling_from_sglang reads (`seed` is this server's
#: own alias of sampling_seed)
SAMPLING_USED = frozenset({
    "max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens", "seed", "sampling_seed"})

#: sampling_params fields that change nothing in the answer: how often a stream sends
#: (this server sends every change), and SGLang's own normalised copies of stop strings
SAMPLING_IGNORED = frozenset({
    "stream_interval", "stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized"})

#: sampling_params fields accepted at these values only
SAMPLING_NEUTRAL = {
    "min_p": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None), "min_new_tokens": (0, None), "n": (1, None), "beam_width": (None, 0, 1),
    "stop_regex": (None, "", []), "json_schema": (None,), "regex": (None,), "ebnf": (None,),
    "structural_tag": (None,), "logit_bias": (None, {}), "custom_params": (None, {}), "watermark": (None,),
    "ebnf_full_assistant": (False, None)}


def neutral(value, allowed) -> bool:
    """Whether `value` is one of the neutral values; a non-empty list is when each of its
    items is (a batch's per-prompt form, `[null, null]`). True is not 1 here, nor False 0."""
    if isinstance(value, list) and value:
        return all(neutral(v, allowed) for v in value)
    for a in allowed:
        if value == a and isinstance(value, bool) == isinstance(a, bool):
            return True
    return False


class UnknownFields:
    """Fields no table names: ignored, each name logged once per place (the first
    request that sends it), so a client's extension does not fill the log."""

    def __init__(self) -> None:
        self._seen: set = set()
        self._lock = threading.Lock()

    def note(self, where: str, names) -> None:
        new = []
        with self._lock:
            for name in sorted(names):
                if (where, name) not in self._seen:
                    if len(self._seen) < 4096:  # bounded: a client sending random names
                        self._seen.add((where, name))
                    new.append(name)
        for name in new:
            log.warning("%s: ignoring the unknown field %r (neither SGLang nor this server reads it)",
                        where, name[:80])


UNKNOWN = UnknownFields()
