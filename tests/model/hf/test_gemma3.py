"""Gemma 3 (text) from a checkpoint directory, exact against transformers."""
import pytest
from harness import COMMON, family_checks, make_checkpoint

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    S, F = "sliding_attention", "full_attention"
    cfg = Gemma3TextConfig(**COMMON, num_hidden_layers=6, head_dim=16, layer_types=[S] * 5 + [F],
                           sliding_window=16, query_pre_attn_scalar=16)
    return make_checkpoint(str(tmp_path_factory.mktemp("gemma3")), Gemma3ForCausalLM, cfg)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_gemma3_is_exact_through_every_tier(gemma3, make_engine, tmp_path, page):
    family_checks(gemma3, make_engine, tmp_path, page)


def test_gemma3_layers_become_components(gemma3):
    from uniradix.model.hf import load_checkpoint
    m = load_checkpoint(gemma3)
    assert [s.name for s in m.states().specs] == ["full", "swa"]
    assert m.states().layers("swa")[0].spec.window == 16


def test_softcapping_as_transformers_does_it(make_engine, tmp_path):
    """Gemma 3 configs carry Gemma 2's caps: final_logit_softcapping caps the logits
    (cap * tanh(x / cap)); attn_logit_softcapping is ignored, as transformers' Gemma 3
    ignores it (QK-norm replaced it)."""
    import random

    from engine_checks import check_exact, greedy, run_checked
    from harness import Oracle, toks
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from uniradix.model.hf import load_checkpoint
    S, F = "sliding_attention", "full_attention"
    cfg = Gemma3TextConfig(**COMMON, num_hidden_layers=3, head_dim=16, layer_types=[S, S, F], sliding_window=8,
                           query_pre_attn_scalar=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    path = make_checkpoint(str(tmp_path / "capped"), Gemma3ForCausalLM, cfg)
    model, oracle = load_checkpoint(path), Oracle(path)
    rng = random.Random(4)
    eng = make_engine(model, page_size=4, max_total_tokens=512, chunked_prefill_size=9)
    reqs = [greedy(toks(rng, 30), 5) for _ in range(3)]
    run_checked(eng, reqs)
    for r in reqs:
        check_exact(eng, r, oracle)
