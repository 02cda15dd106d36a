"""config.json in every form each family has shipped in, read by uniradix and by
transformers' own config class from the same dict. Per layer, the kind, the sliding
window and the RoPE (type, base, scaling factor, partial rotary factor, and the inverse
frequencies and attention scaling transformers' rotary embedding computes from them) must
be equal, and so must the attention shape. The key sets are those of released configs
(legacy `sliding_window_pattern` / `rope_local_base_freq`, `full_attention_interval`,
`hybrid_override_pattern`, sparse multimodal `text_config`s, today's `layer_types` /
`rope_parameters`, missing optional keys). What the loader cannot express is refused,
naming the key. Config dicts only: no weights, fast."""
import copy
import dataclasses
import importlib
import json

import pytest
import torch

pytest.importorskip("transformers")

S, F, L = "sliding_attention", "full_attention", "linear_attention"


# ---------------------------------------------------------------------------- forms
def gemma3_1b(**over):
    """google/gemma-3-1b-it: layers by sliding_window_pattern, the legacy RoPE keys."""
    return {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
            "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
            "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
            "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
            "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
            "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
            "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144, **over}


def gemma3_270m():
    """google/gemma-3-270m: layer_types beside _sliding_window_pattern, legacy RoPE keys."""
    c = gemma3_1b(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, rope_local_base_freq=10000.0,
                  rope_theta=1000000.0, use_bidirectional_attention=False, eos_token_id=1,
                  transformers_version="4.55.0.dev0", _sliding_window_pattern=6, layer_types=([S] * 5 + [F]) * 3)
    del c["sliding_window_pattern"], c["cache_implementation"]
    return c


VISION = {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
          "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}


def gemma3_mm(text):
    """google/gemma-3-{4b,12b,27b}-it: Gemma3ForConditionalGeneration, a sparse text_config."""
    return {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
            "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
            "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3", "text_config": text,
            "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "vision_config": VISION}


LINEAR8 = {"factor": 8.0, "rope_type": "linear"}
GEMMA3_4B = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
             "rope_scaling": LINEAR8, "sliding_window": 1024}
GEMMA3_12B = {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text", "num_attention_heads": 16,
              "num_hidden_layers": 48, "num_key_value_heads": 8, "rope_scaling": LINEAR8, "sliding_window": 1024}
GEMMA3_27B = {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
              "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
              "query_pre_attn_scalar": 168, "rope_scaling": LINEAR8, "sliding_window": 1024}
GEMMA3_CURRENT = {  # what save_pretrained writes today
    "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7,
    "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 16,
    "_sliding_window_pattern": 6, "layer_types": [S] * 5 + [F, S], "query_pre_attn_scalar": 16,
    "rope_parameters": {F: {"factor": 8.0, "rope_theta": 1000000.0, "rope_type": "linear"},
                        S: {"rope_theta": 10000.0, "rope_type": "default"}}}
BARE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "vocab_size": 512}


def qwen3_8b(**over):
    """Qwen/Qwen3-8B."""
    return {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
            "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
            "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
            "use_sliding_window": False, "vocab_size": 151936, **over}


def qwen3_next_80b(**over):
    """Qwen/Qwen3-Next-80B-A3B-Instruct: full_attention_interval, legacy RoPE keys."""
    return {"architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4,
            "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
            "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
            "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
            "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
            "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
            "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "transformers_version": "4.57.0.dev0", "use_cache": True, "use_sliding_window": False,
            "vocab_size": 151936, **over}


QWEN3_5_ROPE = {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                "rope_theta": 10000000, "partial_rotary_factor": 0.25}


def qwen3_5(moe=False):
    """Qwen/Qwen3.5-27B (and -35B-A3B): Qwen3_5ForConditionalGeneration, text_config with
    layer_types and a multimodal rope_parameters."""
    text = {"attention_bias": False, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
            "hidden_size": 5120, "intermediate_size": 17408, "layer_types": ([L] * 3 + [F]) * 16,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 48, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
            "model_type": "qwen3_5_text", "num_attention_heads": 24, "num_hidden_layers": 64,
            "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_parameters": QWEN3_5_ROPE, "vocab_size": 248320,
            "eos_token_id": 248044}
    if moe:
        text = {**text, "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                "num_attention_heads": 16, "num_key_value_heads": 2, "layer_types": ([L] * 3 + [F]) * 10,
                "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512}
        del text["intermediate_size"]
    mt = "qwen3_5_moe" if moe else "qwen3_5"
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
            "image_token_id": 248056, "model_type": mt, "text_config": text, "tie_word_embeddings": False,
            "video_token_id": 248057, "vision_end_token_id": 248054, "vision_start_token_id": 248053,
            "vision_config": {"depth": 2, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128,
                              "out_hidden_size": text["hidden_size"], "model_type": "qwen3_5"}}


YARN_OSS = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
            "rope_type": "yarn", "truncate": False}


def gpt_oss_20b(**over):
    """openai/gpt-oss-20b: layer_types, the legacy rope_theta / rope_scaling (YaRN)."""
    return {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
            "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
            "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
            "intermediate_size": 2880, "layer_types": [S, F] * 12, "max_position_embeddings": 131072,
            "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
            "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
            "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"],
                                    "quant_method": "mxfp4"},
            "rms_norm_eps": 1e-05, "rope_scaling": YARN_OSS, "rope_theta": 150000, "router_aux_loss_coef": 0.9,
            "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
            "vocab_size": 201088, **over}


def granite_h(**over):
    """ibm-granite/granite-4.0-h-tiny: layer_types in the legacy names, no RoPE ("nope")."""
    kinds = ["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 9 + ["attention"] + \
        ["mamba"] * 9 + ["attention"] + ["mamba"] * 5
    return {"architectures": ["GraniteMoeHybridForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "attention_multiplier": 0.0078125, "bos_token_id": 100257, "embedding_multiplier": 12,
            "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.1,
            "intermediate_size": 512, "layer_types": kinds, "logits_scaling": 6, "mamba_chunk_size": 256,
            "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 64, "mamba_d_state": 128,
            "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 48, "mamba_proj_bias": False,
            "max_position_embeddings": 131072, "model_type": "granitemoehybrid", "num_attention_heads": 12,
            "num_experts_per_tok": 6, "num_hidden_layers": len(kinds), "num_key_value_heads": 4,
            "num_local_experts": 64, "output_router_logits": False, "pad_token_id": 100256,
            "position_embedding_type": "nope", "residual_multiplier": 0.22, "rms_norm_eps": 1e-05,
            "rope_scaling": None, "rope_theta": 10000, "router_aux_loss_coef": 0.0, "shared_intermediate_size": 1024,
            "tie_word_embeddings": True, "vocab_size": 100352, **over}


def nemotron_h_8b(**over):
    """nvidia/Nemotron-H-8B-Base-8K: hybrid_override_pattern, attention_head_dim (not read)."""
    return {"architectures": ["NemotronHForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "attention_head_dim": 128, "bos_token_id": 1, "chunk_size": 128, "conv_kernel": 4, "eos_token_id": 2,
            "expand": 2, "hidden_dropout": 0.0, "hidden_size": 4096,
            "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
            "initializer_range": 0.02, "intermediate_size": 21504, "layer_norm_epsilon": 1e-05,
            "mamba_head_dim": 64, "mamba_hidden_act": "silu", "mamba_num_heads": 128, "mamba_proj_bias": False,
            "max_position_embeddings": 8192, "mlp_bias": False, "mlp_hidden_act": "relu2", "model_type": "nemotron_h",
            "n_groups": 8, "num_attention_heads": 32, "num_hidden_layers": 52, "num_key_value_heads": 8,
            "num_logits_to_keep": 1, "pad_token_id": 0, "rescale_prenorm_residual": True, "residual_in_fp32": False,
            "rms_norm_eps": 1e-05, "sliding_window": None, "ssm_state_size": 128, "tie_word_embeddings": False,
            "time_step_floor": 0.0001, "time_step_limit": [0.0, float("inf")], "time_step_max": 0.1,
            "time_step_min": 0.001, "time_step_rank": 256, "use_bias": False, "use_cache": True,
            "use_conv_bias": True, "vocab_size": 131072, **over}


FORMS = {
    # Gemma 3
    "gemma3-1b (sliding_window_pattern, legacy rope)": gemma3_1b(),
    "gemma3-270m (layer_types + _sliding_window_pattern)": gemma3_270m(),
    "gemma3-4b (multimodal, sparse text_config)": gemma3_mm(GEMMA3_4B),
    "gemma3-12b (multimodal)": gemma3_mm(GEMMA3_12B),
    "gemma3-27b (multimodal, own head_dim and scalar)": gemma3_mm(GEMMA3_27B),
    "gemma3 multimodal, text_config without model_type": gemma3_mm(
        {k: v for k, v in GEMMA3_4B.items() if k != "model_type"}),
    "gemma3 current (layer_types, nested rope_parameters)": GEMMA3_CURRENT,
    "gemma3 no RoPE keys at all": {**BARE, "model_type": "gemma3_text"},
    "gemma3 sliding_window_pattern 2": gemma3_1b(sliding_window_pattern=2, num_hidden_layers=7),
    "gemma3 rope_scaling with `type`": gemma3_1b(rope_scaling={"type": "linear", "factor": 4.0}),
    "gemma3 rope_scaling yarn": gemma3_1b(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 8192}),
    "gemma3 rope_parameters with a null kind": {**GEMMA3_CURRENT, "rope_parameters": {
        F: None, S: {"rope_type": "default", "rope_theta": 20000.0}}},
    # transformers' YaRN reads `truncate` from the top of rope_parameters, nested by kind
    # here: it truncates whatever the full layers' setup says (the inverse frequencies differ)
    "gemma3 rope_scaling yarn, truncate false": gemma3_1b(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "truncate": False}),
    "gemma3 nested yarn, truncate false": {**GEMMA3_CURRENT, "rope_parameters": {
        F: {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 512,
            "truncate": False}, S: {"rope_type": "default", "rope_theta": 1e4}}},
    # Qwen3
    "qwen3-8b (rope_theta, no sliding)": qwen3_8b(),
    "qwen3 yarn rope_scaling (long context)": qwen3_8b(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                     "original_max_position_embeddings": 32768}),
    "qwen3-2507 (262k, theta 5M)": qwen3_8b(max_position_embeddings=262144, rope_theta=5000000),
    # Phi-3's form: the pretraining length at the top wins over the one in the setup
    "qwen3 yarn, original length at the top": qwen3_8b(max_position_embeddings=131072,
                                                       original_max_position_embeddings=32768,
                                                       rope_scaling={"rope_type": "yarn", "factor": 4.0}),
    "qwen3 yarn, original length at the top and in the setup": qwen3_8b(
        original_max_position_embeddings=16384,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen3 use_sliding_window (from max_window_layers)": qwen3_8b(use_sliding_window=True, sliding_window=4096,
                                                                 max_window_layers=28),
    "qwen3 current (layer_types, rope_parameters)": {**BARE, "model_type": "qwen3", "layer_types": [F] * 8,
                                                     "rope_parameters": {"rope_type": "default",
                                                                         "rope_theta": 1000000.0}},
    "qwen3 no RoPE keys at all": {**BARE, "model_type": "qwen3"},
    # Qwen3-Next, Qwen3.5
    "qwen3-next-80b (full_attention_interval, legacy rope)": qwen3_next_80b(),
    "qwen3-next without interval or partial factor": {k: v for k, v in qwen3_next_80b().items() if k not in (
        "full_attention_interval", "partial_rotary_factor", "rope_theta", "rope_scaling")},
    "qwen3-next interval 2": qwen3_next_80b(full_attention_interval=2, num_hidden_layers=8),
    "qwen3-next current (layer_types, rope_parameters)": {
        **BARE, "model_type": "qwen3_next", "layer_types": [L, L, L, F] * 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}},
    "qwen3.5-27b (multimodal, mrope keys)": qwen3_5(),
    "qwen3.5-35b-a3b (multimodal moe)": qwen3_5(moe=True),
    "qwen3.5 text only": {**qwen3_5()["text_config"], "model_type": "qwen3_5_text"},
    "qwen3.5 text, sparse": {"model_type": "qwen3_5_text", "num_hidden_layers": 8},
    # gpt-oss
    "gpt-oss-20b (layer_types, legacy yarn)": gpt_oss_20b(),
    "gpt-oss-120b": gpt_oss_20b(num_hidden_layers=36, layer_types=[S, F] * 18, num_local_experts=128),
    "gpt-oss without layer_types or rope keys": {k: v for k, v in gpt_oss_20b().items() if k not in (
        "layer_types", "rope_scaling", "rope_theta")},
    "gpt-oss current (rope_parameters)": {**{k: v for k, v in gpt_oss_20b().items() if k not in (
        "rope_scaling", "rope_theta")}, "rope_parameters": {**YARN_OSS, "rope_theta": 150000.0}},
    "gpt-oss yarn without factor": gpt_oss_20b(rope_scaling={**YARN_OSS, "factor": None}),
    "gpt-oss yarn, original length at the top": gpt_oss_20b(original_max_position_embeddings=8192),
    # Granite-4.0-H
    "granite-4.0-h (mamba/attention names, nope)": granite_h(),
    "granite layers_block_type": {**{k: v for k, v in granite_h().items() if k != "layer_types"},
                                  "layers_block_type": granite_h()["layer_types"]},
    "granite with rope": granite_h(position_embedding_type="rope", rope_theta=10000000),
    "granite without layer_types (all mamba)": {**BARE, "model_type": "granitemoehybrid", "num_attention_heads": 4,
                                                "mamba_n_heads": 8},
    "granite current names": granite_h(layer_types=[{"mamba": L, "attention": F}[k]
                                                    for k in granite_h()["layer_types"]]),
    # Nemotron-H
    "nemotron-h-8b (hybrid_override_pattern)": nemotron_h_8b(),
    "nemotron-3-nano (moe pattern, mamba_* names)": {
        **{k: v for k, v in nemotron_h_8b().items() if k not in ("n_groups", "conv_kernel", "expand")},
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "num_hidden_layers": 52,
        "head_dim": 128, "n_routed_experts": 128, "mamba_n_groups": 8, "mamba_d_conv": 4, "mamba_expand": 2},
    "nemotron-h current (layers_block_type)": {**BARE, "model_type": "nemotron_h",
                                               "layers_block_type": [L, "mlp", F, "moe", L, "mlp"]},
    "nemotron-h no kinds at all": {**BARE, "model_type": "nemotron_h"},
}

#: the rotary embedding class transformers builds per text model_type (None: no RoPE)
ROTARY = {"gemma3_text": "gemma3.modeling_gemma3.Gemma3RotaryEmbedding",
          "qwen3": "qwen3.modeling_qwen3.Qwen3RotaryEmbedding",
          "qwen3_next": "qwen3_next.modeling_qwen3_next.Qwen3NextRotaryEmbedding",
          "qwen3_5_text": "qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding",
          "qwen3_5_moe_text": "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding",
          "gpt_oss": "gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding",
          "granitemoehybrid": "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridRotaryEmbedding",
          "nemotron_h": None}


def transformers_config(raw: dict):
    """The text config transformers builds from config.json."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return CONFIG_MAPPING[raw["model_type"]].from_dict(copy.deepcopy(raw)).get_text_config()


def transformers_layers(raw: dict) -> list[tuple]:
    """Per layer: (kind, window, rope fields, (inv_freq, attention scaling)) as transformers
    derives them; rope None where the layer has no RoPE."""
    from uniradix.model.hf.config_forms import KIND_NAMES
    cfg = transformers_config(raw)
    kinds = [KIND_NAMES[k] for k in cfg.layer_types]
    path = ROTARY[cfg.model_type]
    use_rope = path is not None and getattr(cfg, "position_embedding_type", "rope") == "rope"
    rotary = None
    if use_rope:
        module, cls = path.rsplit(".", 1)
        rotary = getattr(importlib.import_module(f"transformers.models.{module}"), cls)(cfg)
    nested = rotary is not None and isinstance(cfg.rope_parameters, dict) and F in cfg.rope_parameters
    out = []
    for kind in kinds:
        window = cfg.sliding_window if kind == S else None
        rope = None
        if rotary is not None and kind in (F, S):
            params = cfg.rope_parameters[kind] if nested else cfg.rope_parameters
            table = (getattr(rotary, f"{kind}_inv_freq"), getattr(rotary, f"{kind}_attention_scaling")) if nested \
                else (rotary.inv_freq, rotary.attention_scaling)
            rope = (fields(params), table)
        out.append((kind, window, rope))
    return out


def fields(p: dict) -> dict:
    return {k: p.get(k) for k in ("rope_type", "rope_theta", "factor", "partial_rotary_factor")}


def our_reading(raw: dict):
    from uniradix.model.hf import family_for_config
    from uniradix.model.hf.checkpoint import text_config
    text = text_config(raw)
    return family_for_config(text).read_config(text)


@pytest.mark.parametrize("name", list(FORMS))
def test_every_form_reads_as_transformers_reads_it(name):
    from uniradix.model.hf.family import HFModel
    from uniradix.model.hf.ops import rope_inv_freq
    raw = FORMS[name]
    config, layers = our_reading(raw)
    theirs = transformers_layers(raw)
    cfg = transformers_config(raw)
    heads, kv_heads, head_dim = HFModel.attention_shape(config)
    their_head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert (heads, kv_heads, head_dim) == (cfg.num_attention_heads, cfg.num_key_value_heads, their_head_dim)
    assert [(layer.kind, layer.window) for layer in layers] == [(k, w) for k, w, _ in theirs]
    for i, (layer, (_, _, rope)) in enumerate(zip(layers, theirs)):
        if rope is None:
            assert layer.rope is None, (i, layer)
            continue
        want, (inv, scaling) = rope
        got = fields(layer.rope)
        assert {k: got[k] for k in want if want[k] is not None} == {k: v for k, v in want.items() if v is not None}, i
        if want["partial_rotary_factor"] is None:  # transformers rotates the whole head
            assert got["partial_rotary_factor"] in (None, 1.0), i
        ours_inv, ours_scaling = rope_inv_freq(layer.rope, head_dim)
        assert torch.allclose(ours_inv, inv.float(), rtol=1e-6, atol=0), i
        assert ours_scaling == pytest.approx(scaling, rel=1e-12), i


def test_the_forms_cover_every_family():
    from uniradix.model.hf import families, family_for_config
    from uniradix.model.hf.checkpoint import text_config
    covered = {family_for_config(text_config(raw)) for raw in FORMS.values()}
    assert covered == set(families())


def test_defaults_are_the_config_classes_own():
    """Each family's defaults table equals its transformers config class's field defaults
    (a multimodal type: its text config class's)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from uniradix.model.hf import families
    for family in families():
        assert set(family.defaults) == set(family.model_types), family
        for model_type, table in family.defaults.items():
            cls = CONFIG_MAPPING[model_type]
            text = (getattr(cls, "sub_configs_defaults", None) or {}).get("text_config")
            cls = cls if text is None else text.config_class
            defaults = {f.name: f.default for f in dataclasses.fields(cls)}
            for key, value in table.items():
                assert key in defaults, (model_type, key)
                assert defaults[key] == value, (model_type, key, defaults[key], value)


# ---------------------------------------------------------------------------- null keys
def null_cases():
    """(family, a released form of it, a key of its defaults that has a value there)."""
    from uniradix.model.hf import families, family_for_config
    base = {}
    for raw in FORMS.values():
        if "text_config" not in raw:
            base.setdefault(family_for_config(raw), raw)
    return [(f.__name__, base[f], key) for f in families()
            for mt, table in f.defaults.items() if mt == base[f]["model_type"]
            for key, value in table.items() if value is not None]


@pytest.mark.parametrize("family,raw,key", null_cases(), ids=[f"{c[0]}-{c[2]}" for c in null_cases()])
def test_a_null_key_is_refused_naming_it_or_read_as_transformers_reads_it(family, raw, key):
    """config.json giving a key as null: where null means something to the family's config
    class (nullable: no window, KV heads as many as query heads) it reads as transformers
    reads it; anywhere else it is refused at load naming the key (the key would reach the
    forward as None and fail every request, or transformers' typed field refuses it)."""
    from uniradix.model.hf import family_for_config
    from uniradix.model.hf.config_forms import ConfigError
    cls = family_for_config(raw)
    raw = {**raw, key: None}
    if key not in cls.nullable:
        with pytest.raises(ConfigError) as e:
            our_reading(raw)
        assert e.value.key == key and "null" in str(e.value)
        return
    try:
        transformers_config(raw)
    except Exception:  # transformers refuses it: so must we
        with pytest.raises(ConfigError):
            our_reading(raw)
        return
    try:
        config, layers = our_reading(raw)
    except ConfigError as e:  # what null means here, the forward cannot serve (sliding layers with no window)
        assert e.key == key
        return
    from uniradix.model.hf.family import HFModel
    cfg = transformers_config(raw)
    assert HFModel.attention_shape(config)[:2] == (cfg.num_attention_heads, cfg.num_key_value_heads)
    assert [(layer.kind, layer.window) for layer in layers] == [(k, w) for k, w, _ in transformers_layers(raw)]


def test_a_null_legacy_key_is_named_as_written():
    """Nemotron-H's legacy `mamba_n_groups` given as null is refused under that name."""
    from uniradix.model.hf.config_forms import ConfigError
    raw = {k: v for k, v in nemotron_h_8b().items() if k != "n_groups"}
    with pytest.raises(ConfigError) as e:
        our_reading({**raw, "mamba_n_groups": None})
    assert e.value.key == "mamba_n_groups"


# ---------------------------------------------------------------------------- refusals
REFUSED = [
    ("bidirectional Gemma", gemma3_1b(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("dynamic RoPE", gemma3_1b(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type"),
    ("llama3 RoPE", qwen3_8b(rope_scaling=None, rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                                 "rope_theta": 500000.0}),
     "rope_parameters.rope_type"),
    ("nested RoPE where the family has one", qwen3_8b(rope_parameters={F: {"rope_type": "default"}}),
     "rope_parameters"),
    ("flat RoPE where Gemma nests it", {**GEMMA3_CURRENT, "rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 1e6}},
     "rope_parameters"),
    ("partial RoPE where the forward rotates all", {**GEMMA3_CURRENT, "rope_parameters": {
        F: {"rope_type": "default", "partial_rotary_factor": 0.5}, S: {"rope_type": "default"}}},
     "rope_parameters.full_attention.partial_rotary_factor"),
    ("linear RoPE without a factor", gemma3_1b(rope_scaling={"rope_type": "linear"}), "rope_scaling.factor"),
    ("rope_scaling not an object", gemma3_1b(rope_scaling="linear"), "rope_scaling"),
    ("a kind's RoPE not an object", {**GEMMA3_CURRENT, "rope_parameters": {F: "yarn", S: {"rope_type": "default"}}},
     "rope_parameters.full_attention"),
    ("unknown pattern character", nemotron_h_8b(hybrid_override_pattern="M-M*X-"), "hybrid_override_pattern"),
    ("a kind the family lacks", {**BARE, "model_type": "qwen3_next", "layer_types": [L, L, S, F] * 2},
     "layer_types"),
    ("unknown kind name", gemma3_1b(layer_types=["chunked_attention"] * 26), "layer_types[0]"),
    ("sliding layers without use_sliding_window", qwen3_8b(layer_types=[S] * 36, sliding_window=4096),
     "use_sliding_window"),
    ("sliding layer with a null window", gpt_oss_20b(sliding_window=None), "sliding_window"),
    ("layer_types shorter than the model", gemma3_1b(layer_types=[S] * 25), "layer_types"),
    ("a zero period", gemma3_1b(sliding_window_pattern=0), "sliding_window_pattern"),
    ("a zero interval", qwen3_next_80b(full_attention_interval=0), "full_attention_interval"),
    ("_sliding_window_pattern alone, not 6", {k: v for k, v in gemma3_1b(_sliding_window_pattern=3).items()
                                              if k != "sliding_window_pattern"}, "_sliding_window_pattern"),
    ("two kind lists that disagree", granite_h(layers_block_type=["mamba"] * 40), "layer_types"),
    ("unknown position embedding", granite_h(position_embedding_type="alibi"), "position_embedding_type"),
    ("bidirectional", qwen3_8b(is_causal=False), "is_causal"),
    ("another family's layer marker (Bamba's)", {**{k: v for k, v in granite_h().items() if k != "layer_types"},
                                                 "attn_layer_indices": [5, 15]}, "attn_layer_indices"),
    ("another family's layer marker (Qwen3-Next's)", {**{k: v for k, v in gemma3_1b().items()
                                                         if k != "sliding_window_pattern"},
                                                      "full_attention_interval": 4}, "full_attention_interval"),
    ("another activation", gemma3_1b(hidden_activation="gelu"), "hidden_activation"),
]


@pytest.mark.parametrize("why,raw,key", REFUSED, ids=[r[0] for r in REFUSED])
def test_what_cannot_be_expressed_is_refused_naming_the_key(why, raw, key):
    from uniradix.model.hf.config_forms import ConfigError
    with pytest.raises(ConfigError) as e:
        our_reading(raw)
    assert e.value.key == key and f"`{key}`" in str(e.value)


def test_uniradix_run_exits_2_naming_the_key(tmp_path, capsys):
    from uniradix.cli import main
    (tmp_path / "config.json").write_text(json.dumps(gemma3_1b(rope_scaling={"rope_type": "dynamic", "factor": 2.0})))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert main(["run", "--model-path", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "`rope_scaling.rope_type`" in err and "'dynamic'" in err and str(tmp_path) in err
