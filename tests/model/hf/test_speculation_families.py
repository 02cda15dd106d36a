"""Speculative decoding on every family's tiny checkpoint (harness.TINY): the family checks
(chunked prefill, reuse from L1, L2 and L3, decode, preemption) with every engine
verifying drafts that a greedy verify keeps 0 to 3 of, at page sizes 1, 4 and 16: every
logits row the same bits as the model's own no-cache forward, so every kept and every
rejected draft leaves the KV, the window and the recurrent state exactly as decoding one
token a step would (the recurrent families restore the state captured at the accepted
length)."""
import pytest
import torch

from harness import TINY, family_checks, make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = make_tiny(name, str(tmp_path_factory.mktemp(name)))
        return made[name]
    return get


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("family", sorted(TINY))
def test_speculation_is_exact_in_every_family(tiny, family, page, make_engine, tmp_path):
    family_checks(tiny(family), make_engine, tmp_path, page, 2.5e-4 if family in ("nemotron_h", "qwen3_next") else 1e-4,
                  speculate=True)


@pytest.mark.parametrize("dtype,quantization", [(torch.bfloat16, "none"), (torch.float16, "none"),
                                                (torch.float32, "int8"), (torch.bfloat16, "int4")],
                         ids=lambda p: str(p).removeprefix("torch."))
@pytest.mark.parametrize("family", sorted(TINY))
def test_speculation_is_exact_inside_each_precision(tiny, family, dtype, quantization, make_engine, tmp_path):
    """Inside each precision a verify chunk's rows are the same bits as the model's own
    no-cache forward at that precision, through every tier."""
    family_checks(tiny(family), make_engine, tmp_path, 4, dtype=dtype, quantization=quantization, speculate=True)
