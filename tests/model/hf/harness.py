"""Tiny random Hugging Face checkpoints, made with transformers' own config classes and
`save_pretrained` (transformers is a test dependency only), and the oracle: transformers'
forward over the whole sequence, no cache, with explicit position ids.

`family_checks(make, ...)` runs one family through everything the issue asks: our no-cache
forward and the engine's paged forward against the oracle (logits within 1e-4 in float32,
identical greedy tokens) for prefill, chunked prefill, reuse from L1, L2 and L3, decode and
preemption, at page sizes 1, 4 and 16. In every precision (a dtype, a quantization) the
engine's logits are also the same bits as the model's own no-cache forward at that
precision (`check_close`: a row's values do not depend on the rows computed beside it);
the distance of a lower precision from transformers' float32 is measured elsewhere
(test_precision.py, benchmarks/precision.py)."""
from __future__ import annotations

import functools
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine"))
from engine_checks import SPECULATE, check_exact, greedy, run_checked, speculating  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
V = 512
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              bos_token_id=0, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False, initializer_range=0.1)
TOL = 1e-4
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@functools.lru_cache(maxsize=1)
def tokenizer_object():
    """A byte-level BPE of 512 tokens trained on this repository's text (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<bos>", "<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=V, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=specials, show_progress=False)
    files = [str(p) for p in sorted((ROOT / "src").rglob("*.py"))[:40]] + [str(ROOT / "README.md")]
    tok.train(files, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return tok


def save_tokenizer(out: str) -> None:
    from transformers import PreTrainedTokenizerFast
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer_object(), bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


# Tiny checkpoints of every family (the notes' configs): name -> (model class, config
# class, the config's arguments), all transformers' own classes.
L, F, S = "linear_attention", "full_attention", "sliding_attention"
TINY = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_hidden_layers=3, head_dim=16)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(num_hidden_layers=6, head_dim=16, layer_types=[S] * 5 + [F], sliding_window=16,
                    query_pre_attn_scalar=16)),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
                   dict(num_hidden_layers=4, head_dim=16, layer_types=[L, L, L, F], linear_conv_kernel_dim=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig",
                dict(num_hidden_layers=4, head_dim=16, layer_types=[S, F, S, F], sliding_window=16,
                     num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)),
    "granite_hybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                       dict(num_hidden_layers=4, layer_types=[L, L, F, L], mamba_n_heads=8, mamba_d_head=16,
                            mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=64,
                            num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                            position_embedding_type=None)),
    "nemotron_h": ("NemotronHForCausalLM", "NemotronHConfig",
                   dict(layers_block_type=[L, "mlp", F, "mlp", L, "mlp"], head_dim=16, mamba_num_heads=8,
                        mamba_head_dim=16, ssm_state_size=16, n_groups=1, conv_kernel=4, chunk_size=64,
                        expand=2)),
}


def make_tiny(name: str, out: str) -> str:
    """The tiny checkpoint of a family (TINY), saved under `out`."""
    import transformers
    model_cls, config_cls, kw = TINY[name]
    cfg = getattr(transformers, config_cls)(**{**COMMON, **kw})
    return make_checkpoint(out, getattr(transformers, model_cls), cfg)


def make_checkpoint(out: str, model_cls, config) -> str:
    """Seeded random weights for `config`, saved with the tokenizer; returns `out`."""
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(out)
    save_tokenizer(out)
    return out


class Oracle:
    """transformers' no-cache forward over a whole sequence."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def __call__(self, tokens) -> torch.Tensor:
        ids = torch.as_tensor([list(tokens)])
        pos = torch.arange(ids.shape[1])[None]
        return self.model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()


def toks(rng, n):
    return [rng.randrange(8, V) for _ in range(n)]


#: logits tolerance of the engine against the model's own no-cache forward at a lower
#: precision, only where the row-invariant kernels are switched off (UNIRADIX_KERNELS=
#: torch): torch's kernels round a decode step and a prefill differently (measured on the
#: tiny checkpoints: at most 0.023 in bfloat16, 0.007 in float16, 0.025 quantized)
PRECISION_TOL = {torch.bfloat16: 0.1, torch.float16: 0.03, torch.float32: 0.1}


def bit_exact() -> bool:
    """Whether reuse is held to the same bits as the no-cache forward: wherever the
    row-invariant kernels run (every test machine: tests/model/test_kernels.py requires
    them unless UNIRADIX_KERNELS=torch switches them off)."""
    from uniradix.model import kernels
    return kernels.available()


def family_checks(path: str, make_engine, tmp_path, page: int, tol: float = TOL, *,
                  dtype: torch.dtype = torch.float32, quantization: str = "none", speculate: bool = False) -> None:
    """Everything for one checkpoint at one page size (see the module docstring); with
    `speculate`, every engine verifies drafts a greedy verify keeps 0 to 3 of (the
    GreedyDrafter), through every tier: the same checks hold."""
    from uniradix.engine import Engine as _Engine
    from uniradix.hicache.backends.file import FileBackend
    from uniradix.model.hf import load_checkpoint
    load = functools.partial(load_checkpoint, path, dtype, quantization)
    if speculate:
        made = make_engine
        make_engine = lambda *a, **kw: speculating(made(*a, **kw, **SPECULATE))  # noqa: E731
        Engine = lambda *a, **kw: speculating(_Engine(*a, **kw, **SPECULATE))  # noqa: E731
    else:
        Engine = _Engine
    model = load()
    rng = random.Random(page)
    ids = toks(rng, 40)
    # exact inside the precision: the same bits as the same model's own forward, no cache
    same = functools.partial(check_close, oracle=model.reference, tol=PRECISION_TOL[dtype])
    if dtype == torch.float32 and quantization == "none":  # and close to transformers'
        oracle = Oracle(path)
        ours, theirs = model.reference(ids), oracle(ids)
        assert (ours - theirs).abs().max().item() < tol, (ours - theirs).abs().max().item()

        def check(engine, req):
            check_exact(engine, req, oracle=oracle, tol=tol)
            same(engine, req)
    else:
        check = same
    # prefill in chunks, reuse from the device, decode; then preemption under small pools
    eng = make_engine(model, page_size=page, max_total_tokens=2048, chunked_prefill_size=7)
    first = greedy(ids, 6)
    run_checked(eng, [first])
    check(eng, first)
    nxt = greedy(first.input_ids + first.output_ids + toks(rng, 9), 6)
    run_checked(eng, [nxt])
    check(eng, nxt)
    assert nxt.metrics.cached_tokens > 0
    small = make_engine(load(), page_size=page, max_total_tokens=max(4 * page, 96),
                        max_running_requests=4)
    crowd = [greedy(toks(rng, 20), 14) for _ in range(3)]
    run_checked(small, crowd)
    for r in crowd:
        check(small, r)
    # L2: evicted to the host, loaded back
    host = make_engine(load(), page_size=page, max_total_tokens=max(8 * page, 128),
                       enable_hierarchical_cache=True, hicache_ratio=8.0)
    a = greedy(ids, 4)
    run_checked(host, [a])
    for _ in range(3):
        run_checked(host, [greedy(toks(rng, 50), 2)])
    b = greedy(a.input_ids + a.output_ids + toks(rng, 5), 4)
    run_checked(host, [b])
    check(host, b)
    assert b.metrics.host_tokens > 0
    # L3: a fresh engine reuses what another wrote
    store = str(tmp_path / f"l3-{page}")
    w = Engine(load(), page_size=page, storage=FileBackend(store), prefetch_threshold=1)
    c = greedy(ids, 4)
    w.run([c])
    r = Engine(load(), page_size=page, storage=FileBackend(store), prefetch_threshold=1)
    d = greedy(c.input_ids + c.output_ids + toks(rng, 5), 4)
    r.run([d])
    check(r, d)
    assert d.metrics.storage_tokens > 0
    w.close()
    r.close()
    if speculate:
        for e in (eng, small, host, w, r):
            assert e.counters["spec_verify_steps"] > 0 and e.counters["spec_accepted_tokens"] > 0, e.counters


def check_close(engine, req, oracle, tol: float) -> None:
    """The engine's request against the model's own no-cache forward (`oracle`): every
    recorded logits row the same bits, and so every greedy token the oracle's best
    (bit_exact). Only with the row-invariant kernels switched off, within `tol`, each
    greedy token the oracle's best or a tie within `tol` (the next rows are checked
    against the engine's own tokens, so a tie taken the other way hides nothing after it)."""
    assert req.status == "finished", (req.status, req.error)
    prompt, out = list(req.input_ids), list(req.output_ids)
    assert out and len(req.logits) == len(out), (len(req.logits), len(out))
    ref = oracle(prompt + out[:-1])[len(prompt) - 1:]
    got = torch.stack([row for row in req.logits]).to(ref.dtype)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if bit_exact():
        differ = (got != ref).any(-1).nonzero().flatten().tolist()
        assert not differ, (f"request {req.rid}: logits rows {differ[:8]} differ from the no-cache forward's "
                            f"(max {(got.double() - ref.double()).abs().max().item():.3g})")
        if req.sampling.temperature == 0:
            assert ref.argmax(-1).tolist() == out, f"request {req.rid}: greedy tokens differ"
        return
    ref, got = ref.double(), got.double()
    diff = (got - ref).abs().max().item()
    assert diff < tol, f"request {req.rid}: logits differ from the same precision's no-cache forward by {diff}"
    if req.sampling.temperature == 0:
        best = ref.max(-1).values
        picked = ref.gather(1, torch.as_tensor(out)[:, None])[:, 0]
        assert ((best - picked) <= tol).all(), f"request {req.rid}: greedy tokens differ beyond a tie"
