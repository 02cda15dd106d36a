"""A config.json that does not describe its weights is refused at load, naming the keys
and the tensor, as transformers refuses it: served anyway, a wrong head count or head
size failed every request inside the forward (a 500 per request from a server that said
it was healthy), and a wrong hidden size or vocabulary computed another model (Gemma
scales its embedding by sqrt(hidden_size)) or indexed past the embedding. A tensor the
forward reads and the checkpoint lacks is refused at load too, not at the first request.

The head: a config that unties it from the embedding (`tie_word_embeddings` false, the
default of every family's class but Gemma 3's) with no `lm_head.weight` in the file was
served with the embedding as its head, where transformers starts the head from random
values; refused now. A multimodal wrapper's own `tie_word_embeddings` decides, as in
transformers (its text_config's is not read)."""
import json
import random
import shutil

import pytest
import torch
from harness import TINY, Oracle, make_tiny, toks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny(name, str(root / name)) for name in TINY}


def rewritten(src: str, dst, drop=(), tensors=None, **put) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(put)
    (dst / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        from safetensors.torch import load_file, save_file
        t = tensors(load_file(str(dst / "model.safetensors")))
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


#: key -> (value, the keys the refusal names): each disagrees with the tiny weights
#: (hidden 64, 4 heads of 16, 2 KV heads, vocabulary 512)
WRONG = {"num_key_value_heads": (4, "num_key_value_heads"), "head_dim": (8, "head_dim"),
         "num_attention_heads": (2, "num_attention_heads"), "hidden_size": (32, "hidden_size"),
         "vocab_size": (1024, "vocab_size")}


@pytest.mark.parametrize("family", list(TINY))
@pytest.mark.parametrize("key", list(WRONG))
def test_a_config_that_does_not_describe_its_weights_is_refused(tiny, tmp_path, family, key):
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.config_forms import ConfigError
    value, named = WRONG[key]
    path = rewritten(tiny[family], tmp_path / "wrong", **{key: value})
    with pytest.raises(ConfigError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert named in e.value.key and path in msg and "the checkpoint's is" in msg, msg


def test_a_gated_delta_net_config_that_does_not_match_is_refused(tiny, tmp_path):
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.config_forms import ConfigError
    path = rewritten(tiny["qwen3_next"], tmp_path / "gdn", linear_value_head_dim=8)
    with pytest.raises(ConfigError, match="linear_value_head_dim") as e:
        load_checkpoint(path)
    assert "linear_attn" in str(e.value)


def test_a_tensor_the_forward_reads_is_required_at_load(tiny, tmp_path):
    """Every second layer full attention where the weights have every fourth: the
    attention weights of layer 1 are missing; said at load, not by the first request."""
    from uniradix.model.hf import load_checkpoint
    path = rewritten(tiny["qwen3_next"], tmp_path / "interval", drop=("layer_types",), full_attention_interval=2)
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.1\.self_attn\.q_proj\.weight'"):
        load_checkpoint(path)


def drop_head(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if k != "lm_head.weight"}


@pytest.mark.parametrize("family", list(TINY))
def test_an_untied_head_needs_its_weights(tiny, tmp_path, family):
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.config_forms import ConfigError
    untied = rewritten(tiny[family], tmp_path / "untied", tie_word_embeddings=False, tensors=drop_head)
    with pytest.raises(ConfigError, match="lm_head.weight") as e:
        load_checkpoint(untied)
    assert e.value.key == "tie_word_embeddings" and untied in str(e.value)
    # the key left out: the class's default, false for every family here but Gemma 3
    default = rewritten(tiny[family], tmp_path / "default", drop=("tie_word_embeddings",), tensors=drop_head)
    if family == "gemma3":
        from uniradix.model.hf.gemm import unpack
        model = load_checkpoint(default)  # the embedding's values (packed for the CPU's kernel, maybe)
        assert "lm_head.weight" not in model.weights
        assert torch.equal(unpack(model.lm_head), model.w("model.embed_tokens.weight"))
    else:
        with pytest.raises(ConfigError, match="tie_word_embeddings"):
            load_checkpoint(default)


def test_a_tied_head_is_the_embedding_exact_against_transformers(tiny, tmp_path):
    from uniradix.model.hf import load_checkpoint
    path = rewritten(tiny["qwen3"], tmp_path / "tied", tie_word_embeddings=True, tensors=drop_head)
    ids = toks(random.Random(3), 24)
    diff = (load_checkpoint(path).reference(ids) - Oracle(path)(ids)).abs().max().item()
    assert diff < 1e-4, diff


@pytest.fixture(scope="module")
def gemma3_wrapper(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration as released: the head tied to the embedding
    (no lm_head.weight in the file), a sparse text_config."""
    from test_gemma3_released import SPARSE_TEXT, VISION, WRAPPER
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from harness import save_tokenizer
    cfg = Gemma3Config(text_config={**SPARSE_TEXT, "initializer_range": 0.1}, vision_config=VISION,
                       **{k: v for k, v in WRAPPER.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("gemma3-wrapper"))
    Gemma3ForConditionalGeneration(cfg).to(torch.float32).eval().save_pretrained(path)
    save_tokenizer(path)
    with open(f"{path}/config.json", "w") as f:
        json.dump({**WRAPPER, "text_config": SPARSE_TEXT, "vision_config": VISION}, f)
    return path


def test_the_wrappers_flag_decides_whether_the_head_is_tied(gemma3_wrapper, tmp_path):
    """transformers reads the wrapper's tie_word_embeddings (its class's default: true):
    a text_config saying false changes nothing, the wrapper saying false unties a head
    this file does not have."""
    from test_gemma3_released import SPARSE_TEXT

    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.config_forms import ConfigError
    text_says = rewritten(gemma3_wrapper, tmp_path / "text", text_config={**SPARSE_TEXT, "tie_word_embeddings": False})
    ids = toks(random.Random(4), 24)
    diff = (load_checkpoint(text_says).reference(ids) - Oracle(text_says)(ids)).abs().max().item()
    assert diff < 1e-4, diff
    wrapper_says = rewritten(gemma3_wrapper, tmp_path / "wrapper", tie_word_embeddings=False)
    with pytest.raises(ConfigError, match="lm_head.weight") as e:
        load_checkpoint(wrapper_says)
    assert e.value.key == "tie_word_embeddings"


def test_a_gguf_whose_metadata_does_not_describe_its_tensors_is_refused(tmp_path):
    """The same check on a GGUF file, whose metadata is read into the same keys; the
    error names the file's metadata, not a config.json it does not have."""
    pytest.importorskip("gguf")
    from safetensors.torch import load_file
    from test_gguf import GEMMA_IDS, write_gguf
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from harness import COMMON, make_checkpoint
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.config_forms import ConfigError
    cfg = Gemma3TextConfig(**{**COMMON, **GEMMA_IDS}, num_hidden_layers=2, head_dim=16, sliding_window=16,
                           query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
    ckpt = make_checkpoint(str(tmp_path / "hf"), Gemma3ForCausalLM, cfg)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    tensors = load_file(f"{ckpt}/model.safetensors")
    path = str(tmp_path / "wrong.gguf")
    write_gguf(path, {**config, "num_key_value_heads": 4}, tensors, quantized=False)
    with pytest.raises(ConfigError, match="num_key_value_heads") as e:
        load_checkpoint(path)
    assert f"{path}: GGUF metadata" in str(e.value)


def test_a_wrappers_default_is_the_one_read():
    """Where a wrapper's config.json leaves tie_word_embeddings out, its own class's
    default applies; the family's table (the text class's default) must equal it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from uniradix.model.hf import families
    wrappers = [(f, mt) for f in families() for mt in f.model_types if mt in ("gemma3", "qwen3_5", "qwen3_5_moe")]
    assert len(wrappers) == 3
    for family, mt in wrappers:
        assert CONFIG_MAPPING[mt]().tie_word_embeddings == family.defaults[mt]["tie_word_embeddings"], mt
