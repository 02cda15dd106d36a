"""Gemma 3 checkpoints in the forms Google released them, served exact against
transformers loading the same directory:

- the 1B's config.json (`sliding_window_pattern`, `rope_theta`, `rope_local_base_freq`,
  `rope_scaling: null`, no `layer_types`): read as every layer full with the global RoPE
  base, it ran and computed another model (logits off by ~3 here);
- a config with no RoPE keys and no layer markers at all (Gemma3TextConfig's defaults);
- the 4B/12B/27B form: `Gemma3ForConditionalGeneration` with a sparse `text_config`
  (linear RoPE scaling on the full layers, the head size, heads and query scalar left to
  the defaults) and its text model's weights under `language_model.model.*` (older
  files) or `model.language_model.*` with an `lm_head.weight` (newer), served as text.

Tiny dimensions; the weights come from transformers' own classes."""
import json
import random
import shutil

import pytest
import torch
from harness import COMMON, TOL, Oracle, family_checks, make_checkpoint, save_tokenizer, toks

pytest.importorskip("transformers")

#: the 1B's keys (tiny sizes): layers by period, the legacy RoPE keys
LEGACY_1B = {"sliding_window_pattern": 6, "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
             "cache_implementation": "hybrid"}
#: released keys that name no RoPE or layer kinds (left out entirely in the bare form)
MARKERS = ("layer_types", "rope_parameters", "_sliding_window_pattern", "sliding_window_pattern", "rope_theta",
           "rope_local_base_freq", "rope_scaling")


def rewrite_config(path: str, drop=(), **put) -> None:
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    for key in drop:
        config.pop(key, None)
    config.update(put)
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def text_forms(tmp_path_factory):
    """One tiny Gemma 3 (8 layers: 5 sliding, 1 full, 2 sliding, window 16) saved twice:
    with the 1B's legacy keys, and with no RoPE keys or layer markers at all."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(**COMMON, num_hidden_layers=8, head_dim=16, sliding_window=16, query_pre_attn_scalar=16)
    base = make_checkpoint(str(tmp_path_factory.mktemp("gemma3-base")), Gemma3ForCausalLM, cfg)
    out = {}
    for name, put in (("1b-legacy", LEGACY_1B), ("no-rope-keys", {})):
        path = str(tmp_path_factory.mktemp(f"gemma3-{name}"))
        shutil.copytree(base, path, dirs_exist_ok=True)
        rewrite_config(path, drop=MARKERS, **put)
        out[name] = path
    return out


def test_legacy_1b_form_is_exact_through_every_tier(text_forms, make_engine, tmp_path):
    """The wrong-answer bug: transformers derives five sliding layers to one full one and
    two RoPE bases from these keys; so must we, through prefill, reuse, L2, L3 and decode."""
    from uniradix.model.hf import load_checkpoint
    path = text_forms["1b-legacy"]
    family_checks(path, make_engine, tmp_path, page=4)
    model = load_checkpoint(path)
    assert model.kinds == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    assert [s.name for s in model.states().specs] == ["full", "swa"]
    assert model.states().layers("swa")[0].spec.window == 16


def test_config_without_rope_keys_loads_with_the_defaults(text_forms, make_engine):
    """No rope_theta, rope_local_base_freq, rope_scaling or layer markers: the class's
    defaults (1M / 10k, every sixth layer full), exact through chunked prefill and reuse."""
    from engine_checks import check_exact, greedy, run_checked
    from uniradix.model.hf import load_checkpoint
    path = text_forms["no-rope-keys"]
    model, oracle = load_checkpoint(path), Oracle(path)
    ids = toks(random.Random(1), 40)
    diff = (model.reference(ids) - oracle(ids)).abs().max().item()
    assert diff < TOL, diff
    eng = make_engine(model, page_size=4, max_total_tokens=512, chunked_prefill_size=7)
    a = greedy(ids, 4)
    run_checked(eng, [a])
    check_exact(eng, a, oracle)
    b = greedy(a.input_ids + a.output_ids + toks(random.Random(2), 6), 4)
    run_checked(eng, [b])
    check_exact(eng, b, oracle)
    assert b.metrics.cached_tokens > 0


# ---------------------------------------------------------------------------- multimodal
#: the 4B's text_config, tiny: RoPE scaling and window given, heads (8), KV heads (4), head
#: size (256), query scalar (256), RoPE bases and the layer pattern left to the defaults
SPARSE_TEXT = {"hidden_size": 64, "intermediate_size": 128, "model_type": "gemma3_text", "num_hidden_layers": 7,
               "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 16, "vocab_size": 512}
VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "vision_use_head": False}
WRAPPER = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 4,
           "boi_token_index": 4, "eoi_token_index": 5, "image_token_index": 6, "eos_token_id": [2, 7],
           "initializer_range": 0.02}


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """The same tiny Gemma3ForConditionalGeneration in both weight layouts, each with the
    released (sparse) config.json."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    cfg = Gemma3Config(text_config={**SPARSE_TEXT, "initializer_range": 0.1}, vision_config=VISION,
                       **{k: v for k, v in WRAPPER.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32).eval()
    older = str(tmp_path_factory.mktemp("gemma3-mm-older"))
    model.save_pretrained(older)  # transformers writes the older layout: language_model.model.*, head tied
    save_tokenizer(older)
    released = {**WRAPPER, "text_config": SPARSE_TEXT, "vision_config": VISION, "transformers_version": "4.50.0.dev0"}
    with open(f"{older}/config.json", "w") as f:
        json.dump(released, f)
    tensors = load_file(f"{older}/model.safetensors")
    assert any(n.startswith("language_model.model.layers.") for n in tensors)
    newer = str(tmp_path_factory.mktemp("gemma3-mm-newer"))
    shutil.copytree(older, newer, dirs_exist_ok=True)
    renamed = {}
    for name, t in tensors.items():
        new = "model.language_model." + name.removeprefix("language_model.model.") \
            if name.startswith("language_model.model.") else "model." + name
        renamed[new] = t
    renamed["lm_head.weight"] = torch.randn_like(tensors["language_model.model.embed_tokens.weight"]) * 0.1
    save_file(renamed, f"{newer}/model.safetensors", metadata={"format": "pt"})
    rewrite_config(newer, tie_word_embeddings=False)
    return {"older": older, "newer": newer}


@pytest.mark.parametrize("layout", ["older", "newer"])
def test_multimodal_checkpoint_is_served_as_text(multimodal, make_engine, layout):
    from engine_checks import check_exact, greedy, run_checked
    from uniradix.model.hf import load_checkpoint
    path = multimodal[layout]
    model, oracle = load_checkpoint(path), Oracle(path)
    assert type(oracle.model).__name__ == "Gemma3ForConditionalGeneration"
    assert model.kinds == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert (model.heads, model.kv_heads, model.head_dim, model.scale) == (8, 4, 256, 256 ** -0.5)
    assert not any("vision" in n or "projector" in n for n in model.weights)  # the text model only
    assert model.eos_token_ids == (2, 7)  # the wrapper's own
    ids = toks(random.Random(3), 40)
    diff = (model.reference(ids) - oracle(ids)).abs().max().item()
    assert diff < TOL, diff
    eng = make_engine(model, page_size=4, max_total_tokens=512, chunked_prefill_size=9)
    a = greedy(ids, 4)
    run_checked(eng, [a])
    check_exact(eng, a, oracle)
    b = greedy(a.input_ids + a.output_ids + toks(random.Random(4), 5), 4)
    run_checked(eng, [b])
    check_exact(eng, b, oracle)
    assert b.metrics.cached_tokens > 0


def test_a_refused_config_names_the_checkpoint_and_the_key(text_forms, tmp_path):
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.config_forms import ConfigError
    path = str(tmp_path / "bidirectional")
    shutil.copytree(text_forms["1b-legacy"], path)
    rewrite_config(path, use_bidirectional_attention=True)
    with pytest.raises(ConfigError, match="use_bidirectional_attention") as e:
        load_checkpoint(path)
    assert path in str(e.value)
