"""Qwen3 (dense, full attention only: the control beside the hybrids), exact against
transformers."""
import pytest
from harness import COMMON, family_checks, make_checkpoint

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(**COMMON, num_hidden_layers=3, head_dim=16)
    return make_checkpoint(str(tmp_path_factory.mktemp("qwen3")), Qwen3ForCausalLM, cfg)


@pytest.mark.parametrize("page", [1, 16])
def test_qwen3_is_exact_through_every_tier(qwen3, make_engine, tmp_path, page):
    family_checks(qwen3, make_engine, tmp_path, page)


def test_qwen3_keeps_only_full_attention_state(qwen3):
    from uniradix.model.hf import load_checkpoint
    assert [s.name for s in load_checkpoint(qwen3).states().specs] == ["full"]
