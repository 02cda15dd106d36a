"""gpt-oss from a checkpoint directory, exact against transformers (eager attention, its
default): sliding/full layers with sinks, YaRN, biased MoE with the clamped SwiGLU, and
MXFP4 expert weights dequantized at load."""
import json
import random
import shutil

import pytest
import torch
from harness import COMMON, V, Oracle, TOL, family_checks, save_tokenizer

pytest.importorskip("transformers")

S, F = "sliding_attention", "full_attention"


def _config(**over):
    from transformers import GptOssConfig
    return GptOssConfig(**{**COMMON, "intermediate_size": 64, "num_hidden_layers": 4, "head_dim": 16,
                           "layer_types": [S, F, S, F], "sliding_window": 16, "num_local_experts": 4,
                           "num_experts_per_tok": 2, **over})


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """The notes' tiny config, seeded; the parameters transformers initialises to zeros or
    ones (q/k/v/o and expert biases, norm weights) made random so they count, and the
    gate/up weights scaled so the SwiGLU's clamps at +-7 are reached."""
    from transformers import GptOssForCausalLM
    out = str(tmp_path_factory.mktemp("gpt_oss"))
    torch.manual_seed(0)
    model = GptOssForCausalLM(_config()).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith(("_proj.bias", "_proj_bias")):
                p.normal_(0.0, 0.1)
            elif name.endswith("experts.gate_up_proj"):
                p.mul_(4.0)
    model.save_pretrained(out)
    save_tokenizer(out)
    return out


@pytest.mark.parametrize("page", [1, 4, 16])
def test_gpt_oss_is_exact_through_every_tier(gpt_oss, make_engine, tmp_path, page):
    family_checks(gpt_oss, make_engine, tmp_path, page)


def test_gpt_oss_layers_become_components(gpt_oss):
    from uniradix.model.hf import load_checkpoint
    m = load_checkpoint(gpt_oss)
    assert [s.name for s in m.states().specs] == ["full", "swa"]
    assert m.states().layers("swa")[0].spec.window == 16
    assert [ls.layer for ls in m.states().layers("swa")] == [0, 2]
    assert [ls.layer for ls in m.states().layers("full")] == [1, 3]


def test_gpt_oss_checkpoint_reaches_the_clamps(gpt_oss):
    """The fixture's experts see gate/up values beyond the SwiGLU limit (else the clamps
    would go untested)."""
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.ops import rms_norm
    m = load_checkpoint(gpt_oss)
    ids = torch.as_tensor([random.Random(0).randrange(8, V) for _ in range(40)])
    h = rms_norm(m.embed(ids), m.w("model.layers.0.post_attention_layernorm.weight"), m.eps)
    from uniradix.model.hf.gemm import unpack
    gu = torch.einsum("nd,eid->eni", h, unpack(m.w("model.layers.0.mlp.experts.gate_up_proj")))  # [E, out, in]
    assert (gu[..., 0::2] > 7).any() and (gu[..., 1::2].abs() > 7).any()


@pytest.mark.parametrize("rope", [
    {},  # the tiny config: GptOssConfig's default YaRN
    {"head_dim": 64},  # the released models' head size
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": True, "original_max_position_embeddings": 4096}},
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                         "original_max_position_embeddings": 2048, "attention_factor": 1.25}},
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": None,
                         "original_max_position_embeddings": 4096}, "max_position_embeddings": 65536},
])
def test_gpt_oss_yarn_matches_transformers(rope):
    """Our inverse frequencies and attention factor against transformers' YaRN, from the
    config.json it writes (current form) and from the legacy rope_theta / rope_scaling."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from uniradix.model.hf.gpt_oss import GptOss
    from uniradix.model.hf.ops import rope_inv_freq
    cfg = _config(**rope)
    want_inv, want_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    current = cfg.to_dict()
    legacy = {k: v for k, v in current.items() if k != "rope_parameters"}
    legacy["rope_theta"] = current["rope_parameters"]["rope_theta"]
    legacy["rope_scaling"] = {k: v for k, v in current["rope_parameters"].items() if k != "rope_theta"}
    for c in (current, legacy):
        _, layers = GptOss.read_config(c)
        inv, scale = rope_inv_freq(layers[0].rope, cfg.head_dim)
        assert torch.equal(inv, want_inv) and scale == want_scale


def test_gpt_oss_mxfp4_experts_are_dequantized_exactly(gpt_oss, tmp_path):
    """Expert weights stored as MXFP4 blocks and scales (the released checkpoints' form):
    ours against transformers' dequantizer, and the forward against transformers loading
    the same checkpoint (which dequantizes on a CPU)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.gpt_oss import dequantize_mxfp4
    out = str(tmp_path / "mxfp4")
    shutil.copytree(gpt_oss, out)
    tensors = load_file(f"{out}/model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, n_in, n_out = tensors.pop(name).shape
        blocks = torch.randint(0, 256, (E, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 130, (E, n_out, n_in // 32), dtype=torch.uint8, generator=g)
        assert torch.equal(dequantize_mxfp4(blocks, scales), convert_moe_packed_tensors(blocks, scales,
                                                                                        dtype=torch.float32))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
    with open(f"{out}/config.json") as f:
        config = json.load(f)
    # "dequantize": transformers would otherwise want `accelerate` (not installed) for MXFP4
    config["quantization_config"] = {"quant_method": "mxfp4", "dequantize": True, "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(f"{out}/config.json", "w") as f:
        json.dump(config, f)
    ids = [random.Random(3).randrange(8, V) for _ in range(40)]
    model = load_checkpoint(out)
    assert not any(n.endswith(("_blocks", "_scales")) for n in model.weights)
    diff = (model.reference(ids) - Oracle(out)(ids)).abs().max().item()
    assert diff < TOL, diff
    # a blocks tensor without its scales is refused by name
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts.down_proj_blocks"):
        load_checkpoint(out)
