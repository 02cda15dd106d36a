"""Granite-4.0-H (granitemoehybrid) from a checkpoint directory, exact against transformers."""
import random

import pytest
from harness import COMMON, TOL, Oracle, family_checks, make_checkpoint, toks

pytest.importorskip("transformers")

L, F = "linear_attention", "full_attention"
# μP multipliers as Granite-4.0-H sets them (not 1.0), so each one is exercised
MUP = dict(embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=4.0)


def config(**kw):
    from transformers import GraniteMoeHybridConfig
    args = dict(num_hidden_layers=4, layer_types=[L, L, F, L], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=64, num_local_experts=4, num_experts_per_tok=2,
                shared_intermediate_size=64, position_embedding_type=None, **MUP)
    return GraniteMoeHybridConfig(**COMMON, **{**args, **kw})


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    from transformers import GraniteMoeHybridForCausalLM
    return make_checkpoint(str(tmp_path_factory.mktemp("granite")), GraniteMoeHybridForCausalLM, config())


@pytest.mark.parametrize("page", [1, 4, 16])
def test_granite_hybrid_is_exact_through_every_tier(granite, make_engine, tmp_path, page):
    family_checks(granite, make_engine, tmp_path, page)


def test_granite_hybrid_layers_become_components(granite):
    from uniradix.model.hf import load_checkpoint
    m = load_checkpoint(granite)
    assert [s.name for s in m.states().specs] == ["full", "mamba"]
    assert [ls.layer for ls in m.states().layers("mamba")] == [0, 1, 3]
    assert [ls.layer for ls in m.states().layers("full")] == [2]
    shape = m.states().layers("mamba")[0].shape
    assert (shape.conv_shape, shape.state_shape) == ((128 + 2 * 16, 3), (8, 16, 16))
    assert (shape.conv_dtype, shape.state_dtype) == ("float32", "float32")


def test_granite_hybrid_released_config_names(granite, tmp_path):
    """Granite-4.0-H's released configs name the kinds "mamba" / "attention" and say
    position_embedding_type "nope": read as the current names."""
    import json
    import shutil

    import torch

    from uniradix.model.hf import load_checkpoint
    old = shutil.copytree(granite, tmp_path / "released")
    c = json.loads((old / "config.json").read_text())
    c["layer_types"] = ["mamba", "mamba", "attention", "mamba"]
    c["position_embedding_type"] = "nope"
    c["time_step_limit"] = [0.0, 1e30]
    (old / "config.json").write_text(json.dumps(c))
    ids = toks(random.Random(3), 24)
    assert torch.equal(load_checkpoint(str(old)).reference(ids), load_checkpoint(granite).reference(ids))


def test_granite_hybrid_with_rope_and_two_groups(tmp_path):
    """The options the tiny checkpoint above leaves off: RoPE on the attention layers,
    B and C in two groups (and the gated norm over two groups), a dt limit."""
    from transformers import GraniteMoeHybridForCausalLM

    from uniradix.model.hf import load_checkpoint
    path = make_checkpoint(str(tmp_path / "granite-rope"), GraniteMoeHybridForCausalLM,
                           config(position_embedding_type="rope", mamba_n_groups=2, time_step_limit=(0.05, 2.0)))
    ids = toks(random.Random(1), 80)
    diff = (load_checkpoint(path).reference(ids) - Oracle(path)(ids)).abs().max().item()
    assert diff < TOL, diff


@pytest.mark.parametrize("T", [2, 63, 64, 65, 200])
def test_chunked_scan_equals_the_token_recurrence(T):
    """The closed-form chunked scan against s_t = a_t s_{t-1} + xdt_t B_t^T, y_t = s_t C_t
    token by token, across chunk edges, from a non-zero state; and a sequence split
    anywhere resumes to the same outputs and state."""
    import torch
    from uniradix.model.hf.granite_hybrid import chunked_scan
    g = torch.Generator().manual_seed(T)
    Bn, H, P, N = 2, 4, 8, 16
    xdt = torch.randn(Bn, T, H, P, generator=g)
    log_decay = -torch.rand(Bn, T, H, generator=g) * 0.5
    B, C = torch.randn(Bn, T, H, N, generator=g), torch.randn(Bn, T, H, N, generator=g)
    s0 = torch.randn(Bn, H, P, N, generator=g)
    s, ys = s0, []
    for t in range(T):
        s = s * torch.exp(log_decay[:, t])[..., None, None] + xdt[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append((s @ C[:, t, :, :, None]).squeeze(-1))
    want = torch.stack(ys, 1)
    y, state = chunked_scan(xdt, log_decay, B, C, s0)
    scale = want.abs().max().item()
    assert (y - want).abs().max().item() <= 1e-5 * scale
    assert (state - s).abs().max().item() <= 1e-5 * s.abs().max().item()
    k = T // 3 + 1
    y1, mid = chunked_scan(xdt[:, :k], log_decay[:, :k], B[:, :k], C[:, :k], s0)
    y2, end = chunked_scan(xdt[:, k:], log_decay[:, k:], B[:, k:], C[:, k:], mid)
    assert (torch.cat((y1, y2), 1) - want).abs().max().item() <= 1e-5 * scale
    assert (end - s).abs().max().item() <= 1e-5 * s.abs().max().item()
