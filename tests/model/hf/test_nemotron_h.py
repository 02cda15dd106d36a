"""Nemotron-H (nemotron_h) from a checkpoint directory, exact against transformers.

The engine is the same bits as the model's own no-cache forward (harness.check_close);
against transformers' float32 forward (whose Mamba2 scan runs chunk by chunk, in another
order than our token loop), logits stay within MAMBA_TOL: measured up to 1.65e-4 of
logits up to 3.7 on the tiny checkpoint's prompts, with the row-invariant kernels and
with torch's alike, which is above harness.TOL."""
import random

import pytest
from harness import COMMON, TOL, Oracle, family_checks, save_tokenizer, toks

pytest.importorskip("transformers")

L, F = "linear_attention", "full_attention"
MAMBA_TOL = 2.5e-4


def config(kinds, **kw):
    from transformers import NemotronHConfig
    return NemotronHConfig(**COMMON, layers_block_type=kinds, head_dim=16, mamba_num_heads=8, mamba_head_dim=16,
                           ssm_state_size=16, n_groups=1, conv_kernel=4, chunk_size=64, expand=2, **kw)


def make(out, cfg, bias=False):
    """As harness.make_checkpoint; `bias`: random MoE score-correction biases (the
    initialisation leaves them zero)."""
    import torch
    from transformers import NemotronHForCausalLM
    torch.manual_seed(0)
    model = NemotronHForCausalLM(cfg).to(torch.float32).eval()
    if bias:
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    model.save_pretrained(out)
    save_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return make(str(tmp_path_factory.mktemp("nemotron_h")), config([L, "mlp", F, "mlp", L, "mlp"]))


@pytest.mark.parametrize("page", [1, 4, 16])
def test_nemotron_h_is_exact_through_every_tier(nemotron, make_engine, tmp_path, page):
    family_checks(nemotron, make_engine, tmp_path, page, MAMBA_TOL)


def test_nemotron_h_layers_become_components(nemotron):
    from uniradix.model.hf import load_checkpoint
    m = load_checkpoint(nemotron)
    assert [s.name for s in m.states().specs] == ["full", "mamba"]
    assert [ls.layer for ls in m.states().layers("mamba")] == [0, 4]
    assert [ls.layer for ls in m.states().layers("full")] == [2]
    assert m.states().layer_ids == [0, 2, 4]  # the MLP layers keep nothing
    shape = m.states().layers("mamba")[0].shape
    assert (shape.conv_shape, shape.state_shape) == ((128 + 2 * 16, 3), (8, 16, 16))


def test_nemotron_h_legacy_config(nemotron, tmp_path):
    """A config as older Nemotron-H checkpoints write it (hybrid_override_pattern, mamba_*
    names for the mixer's settings) reads as the current one."""
    import json
    import shutil

    import torch

    from uniradix.model.hf import load_checkpoint
    old = shutil.copytree(nemotron, tmp_path / "legacy")
    c = json.loads((old / "config.json").read_text())
    c["hybrid_override_pattern"] = "M-*-M-"
    for new, legacy in (("n_groups", "mamba_n_groups"), ("conv_kernel", "mamba_d_conv"), ("expand", "mamba_expand"),
                        ("time_step_min", "mamba_dt_min"), ("chunk_size", "mamba_chunk_size")):
        c[legacy] = c.pop(new)
    del c["layers_block_type"]
    (old / "config.json").write_text(json.dumps(c))
    ids = toks(random.Random(3), 24)
    assert torch.equal(load_checkpoint(str(old)).reference(ids), load_checkpoint(nemotron).reference(ids))


def test_nemotron_h_moe_layers(tmp_path, make_engine):
    """MoE layers (grouped sigmoid routing with correction biases, scaled weights, a
    shared expert) keep no cache either; exact with no cache and through chunked
    prefill, reuse and decode."""
    from engine_checks import check_exact, greedy, run_checked

    from uniradix.model.hf import load_checkpoint
    cfg = config([L, "moe", F, "mlp", L, "moe"], n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                 topk_group=1, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                 routed_scaling_factor=2.5)
    path = make(str(tmp_path / "nemotron-moe"), cfg, bias=True)
    oracle, model = Oracle(path), load_checkpoint(path)
    assert [s.name for s in model.states().specs] == ["full", "mamba"]
    assert model.states().layer_ids == [0, 2, 4]
    rng = random.Random(7)
    ids = toks(rng, 40)
    diff = (model.reference(ids) - oracle(ids)).abs().max().item()
    assert diff < TOL, diff
    eng = make_engine(model, page_size=4, max_total_tokens=512, chunked_prefill_size=7)
    a = greedy(ids, 5)
    run_checked(eng, [a])
    check_exact(eng, a, oracle)
    b = greedy(a.input_ids + a.output_ids + toks(rng, 6), 5)
    run_checked(eng, [b])
    check_exact(eng, b, oracle)
    assert b.metrics.cached_tokens > 0
