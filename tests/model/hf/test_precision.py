"""Lower precisions: bfloat16 and float16 weights, weight-only int8 and int4 linears.

Inside each precision reuse stays exact: every family through every tier gives the same
bits as its own no-cache forward at that precision (harness.family_checks with a dtype
and a quantization), since every product goes through the row-invariant kernels. The forward at bfloat16 / float16 tracks transformers' at the same dtype
(what it keeps in float32 is what the family needs). The quantized weights and the one
linear op: torch's kernels against the dequantized values, the shapes the kernels do
not take, rows computed alike however many come together (what keeps reuse exact), and
torch's paths where the kernels are switched off (within a bound, not bit for bit). What the L3 namespace sees of a
precision, the setting and the flag. The distance of each precision from transformers'
float32 on the real Gemma 3 270M is measured by benchmarks/precision.py (docs/models.md)."""
from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F
from harness import TINY, V, family_checks, make_tiny, toks

pytest.importorskip("transformers")

#: (dtype, quantization) pairs run through every tier, for every family
PRECISIONS = [(torch.bfloat16, "none"), (torch.float16, "none"), (torch.float32, "int8"),
              (torch.float32, "int4"), (torch.bfloat16, "int4")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Each family's tiny checkpoint, made on first use."""
    root = tmp_path_factory.mktemp("precision")
    return functools.cache(lambda family: make_tiny(family, str(root / family)))


# ---------------------------------------------------------------------------- every family, every tier
@pytest.mark.parametrize("dtype,quantization", PRECISIONS, ids=lambda p: str(p).removeprefix("torch."))
@pytest.mark.parametrize("family", list(TINY))
def test_reuse_is_exact_inside_each_precision(tiny, family, dtype, quantization, make_engine, tmp_path):
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.quant import is_quantized
    path = tiny(family)
    model = load_checkpoint(path, dtype, quantization)
    assert model.dtype == dtype and model.quantization == quantization
    assert {s.dtype for ls in model.layer_states() for s in [ls.shape] if hasattr(s, "dtype")} <= \
        {str(dtype).removeprefix("torch.")}
    if quantization != "none":
        assert is_quantized(model.lm_head) and model.lm_head.scheme in ("int8", quantization)
        assert not is_quantized(model.w(model.embed_weight))  # the lookup stays dense
    family_checks(path, make_engine, tmp_path, 4, dtype=dtype, quantization=quantization)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("family", list(TINY))
def test_the_cache_off_engine_agrees_with_itself_however_a_prompt_is_cut(tiny, family, dtype, make_engine):
    """With reuse off, the same requests through chunks of 3, 7 and 64 tokens, alone and
    beside others, give the same bits (issue 29: 4 of 14 chunk-size pairs were bit-equal
    in float16): attention over a chunk equals attention over the cache, and the
    recurrences reach the same state however the prompt is cut."""
    from engine_checks import greedy, run_checked
    from harness import bit_exact
    from uniradix.model.hf import load_checkpoint
    if not bit_exact():
        pytest.skip("the row-invariant kernels are switched off")
    model = load_checkpoint(tiny(family), dtype)
    rng = random.Random(11)
    prompts = [toks(rng, n) for n in (29, 13, 41)]
    runs = []
    for chunk, together in ((3, False), (7, True), (64, True), (64, False)):
        eng = make_engine(model, page_size=4, chunked_prefill_size=chunk, disable_radix_cache=True)
        reqs = [greedy(p, 5) for p in prompts]
        if together:
            run_checked(eng, reqs)
        else:
            for r in reqs:
                run_checked(eng, [r])
        runs.append([(r.output_ids, torch.stack(r.logits)) for r in reqs])
    for other in runs[1:]:
        for (ids_a, logits_a), (ids_b, logits_b) in zip(runs[0], other):
            assert ids_a == ids_b and torch.equal(logits_a, logits_b)


@pytest.mark.parametrize("family", list(TINY))
def test_every_projection_is_quantized(tiny, family):
    """After quantize, what stays dense is the embedding, norms, routers and gates, the
    recurrent layers' convolutions and parameters: no projection is left out."""
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.quant import QuantizedExperts, is_quantized
    dense = load_checkpoint(tiny(family))
    model = load_checkpoint(tiny(family), quantization="int8")
    assert model.linear_weights() == []  # nothing dense is left to quantize
    for name, w in model.weights.items():
        if is_quantized(w):
            d = dense.weights.get(name, dense.tied_head())
            assert tuple(w.shape) == tuple(d.shape), name
            assert isinstance(w, QuantizedExperts) == (d.dim() == 3), name
            continue
        left = name == model.embed_weight or name.endswith(model.dense_weights) or w.dim() == 1 \
            or name.endswith(("conv1d.weight", "_bias"))  # gpt-oss's expert biases [E, out]
        assert left, f"{family}: {name} {tuple(w.shape)} stayed dense"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", list(TINY))
def test_half_precision_tracks_transformers_at_that_dtype(tiny, family, dtype):
    """Our no-cache forward at bfloat16 / float16 against transformers' at the same
    dtype, from the same float32 file. Most rows agree within a few of the dtype's
    roundings; a row where a random router's near-tie flips an expert may not (MoE
    families), so the bound is on 90% of the rows."""
    from transformers import AutoModelForCausalLM
    from uniradix.model.hf import load_checkpoint
    path = tiny(family)
    ids = toks(random.Random(1), 40)
    theirs_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        theirs = theirs_model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None],
                              use_cache=False).logits[0].float()
    ours = load_checkpoint(path, dtype).reference(ids)
    rows = (ours - theirs).abs().amax(-1)
    bound = 0.15 if dtype == torch.bfloat16 else 0.03  # measured: at most 0.08 and 0.008 off the flips
    assert (rows <= bound).float().mean().item() >= 0.9, rows.tolist()


# ---------------------------------------------------------------------------- the quantized weights
SHAPES = [(64, 64), (96, 160), (48, 32)]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_quantized_linear_is_its_dequantized_weight_in_bfloat16(scheme, shape):
    from uniradix.model.hf.ops import linear
    from uniradix.model.hf.quant import KERNEL_ROWS, quantize
    torch.manual_seed(0)
    w = torch.randn(*shape) * 0.05
    q = quantize(w, scheme)
    assert q.scheme == scheme and tuple(q.shape) == shape
    deq = q.dequantize()
    err = ((deq - w).norm() / w.norm()).item()
    assert err < (0.01 if scheme == "int8" else 0.1), err  # measured 0.006 and 0.08 on Gaussian weights
    for rows in (0, 1, KERNEL_ROWS, KERNEL_ROWS + 1, 3 * KERNEL_ROWS + 5):
        x = torch.randn(rows, shape[1])
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            y = linear(x.to(dtype), q)
            assert y.dtype == dtype and y.shape == (rows, shape[0])
            ref = x.to(dtype).to(torch.bfloat16).float() @ deq.t()  # the activations multiply in bfloat16
            assert torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2), (rows, dtype)
    b = torch.randn(shape[0])
    x = torch.randn(3, 5, shape[1])  # any leading shape, and a bias
    assert torch.allclose(linear(x, q, b), linear(x.reshape(15, -1), q).reshape(3, 5, -1) + b)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_kernel_rows_do_not_depend_on_the_rows_beside_them(scheme):
    """A token's row through the packed kernel is the same bits whether it comes alone
    (a decode step) or with others (a prefill chunk, the no-cache forward): what keeps
    reuse exact inside a quantized precision (a dense path for many rows rounded
    differently and flipped MoE routing)."""
    from uniradix.model.hf.quant import quantize
    torch.manual_seed(1)
    q = quantize(torch.randn(256, 640), scheme)
    x = torch.randn(100, 640)
    together = q.linear(x)
    alone = torch.cat([q.linear(x[i:i + 1]) for i in range(100)])
    in_sevens = torch.cat([q.linear(x[i:i + 7]) for i in range(0, 100, 7)])
    assert torch.equal(together, alone) and torch.equal(together, in_sevens)


def test_shapes_the_kernels_do_not_take():
    """int4 needs rows in 16s and columns in groups of 32: other weights fall back to
    int8; int8's kernel reads the input in 16s (a 33-column weight crashed it): such a
    weight multiplies densely."""
    from uniradix.model.hf.quant import Int4Weight, Int8Weight, quantize
    torch.manual_seed(2)
    for shape in [(17, 64), (64, 48), (1, 64)]:
        assert isinstance(quantize(torch.randn(*shape), "int4"), Int8Weight), shape
    assert isinstance(quantize(torch.randn(32, 64), "int4"), Int4Weight)
    w = torch.randn(24, 33)
    q = quantize(w, "int8")
    assert q.kernel(torch.randn(2, 33, dtype=torch.bfloat16)) is None
    x = torch.randn(2, 33)
    assert torch.allclose(q.linear(x), x @ w.t(), rtol=0.05, atol=0.05)


def test_expert_stacks_and_bad_input():
    from uniradix.model.hf.quant import QuantizedExperts, check_scheme, quantize
    stack = torch.randn(3, 32, 64)
    q = quantize(stack, "int4")
    assert isinstance(q, QuantizedExperts) and len(q) == 3 and tuple(q.shape) == (3, 32, 64)
    assert torch.allclose(q[1].dequantize(), quantize(stack[1], "int4").dequantize())
    first = stack[0]
    assert quantize(first, "none") is first
    with pytest.raises(ValueError, match="int5"):
        check_scheme("int5")
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(4, 4, dtype=torch.int32), "int8")
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(4), "int8")


def test_float16_without_a_fast_gemm_multiplies_in_float32(monkeypatch):
    """Where the row-invariant kernels are switched off (torch's kernels): on a CPU without
    AVX512-FP16 / AMX-FP16, torch's float16 GEMM is a scalar loop (10x bfloat16's), so
    more than one row multiplies in float32 and rounds once; one row keeps float16 (its
    matrix-vector path is fast). With the kernels, every row count is one path."""
    from uniradix.model import kernels
    from uniradix.model.hf import gemm
    from uniradix.model.hf.ops import linear
    torch.manual_seed(3)
    w, b = torch.randn(48, 64).half(), torch.randn(48).half()
    x = torch.randn(5, 64).half()
    if kernels.available():
        assert torch.equal(torch.cat([linear(x[i:i + 1], w, b) for i in range(5)]), linear(x, w, b))
    monkeypatch.setattr(kernels, "available", lambda: False)
    monkeypatch.setattr(gemm, "fast_cpu_gemm", lambda dtype: False)
    assert gemm.gemm_dtype(torch.float16, torch.device("cpu")) == torch.float32
    assert gemm.gemm_dtype(torch.float16, torch.device("meta")) == torch.float16  # a GPU multiplies natively
    assert torch.equal(linear(x, w, b), F.linear(x.float(), w.float(), b.float()).half())
    assert torch.equal(linear(x[:1], w, b), F.linear(x[:1], w, b))
    monkeypatch.setattr(gemm, "fast_cpu_gemm", lambda dtype: True)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("fast", [True, False], ids=["16-bit-gemm", "float32-gemm"])
@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
def test_torchs_kernels_keep_reuse_within_the_precisions_bound(tiny, family, fast, monkeypatch, make_engine,
                                                                 tmp_path):
    """With the row-invariant kernels switched off (UNIRADIX_KERNELS=torch, no compiler),
    on both paths a CPU may take (AVX512-BF16 / AMX: bfloat16 products; any other CPU:
    float32 products for more than one row), reuse from every tier stays within the
    precision's bound of the same model's no-cache forward: the rows depend on their
    neighbours, which is what the kernels remove."""
    from uniradix.model import kernels
    from uniradix.model.hf import gemm, load_checkpoint
    monkeypatch.setattr(kernels, "available", lambda: False)
    monkeypatch.setattr(gemm, "fast_cpu_gemm", lambda dtype: fast)
    assert gemm.gemm_dtype(torch.bfloat16, torch.device("cpu")) == (torch.bfloat16 if fast else torch.float32)
    model = load_checkpoint(tiny(family), torch.bfloat16)
    assert not any(isinstance(w, (kernels.PackedWeight, kernels.PackedExperts)) for w in model.weights.values())
    family_checks(tiny(family), make_engine, tmp_path, 4, dtype=torch.bfloat16)


def test_bfloat16_is_fast_only_with_its_instructions(monkeypatch):
    """AVX-512 alone makes bfloat16 products 3-4x slower than float32 (oneDNN converts):
    only AVX512-BF16 or AMX count."""
    from uniradix.model.hf import gemm
    for flags, fast in (({"_is_avx512_supported"}, False), ({"_is_avx512_supported", "_is_avx512_bf16_supported"},
                                                             True), ({"_is_amx_tile_supported"}, True), (set(), False)):
        for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
            monkeypatch.setattr(torch.cpu, name, lambda on=name in flags: on, raising=False)
        gemm.fast_cpu_gemm.cache_clear()
        assert gemm.fast_cpu_gemm(torch.bfloat16) is fast, flags
    gemm.fast_cpu_gemm.cache_clear()


# ---------------------------------------------------------------------------- L3, loading, flags
def test_each_precision_is_its_own_l3_namespace(tiny, tmp_path):
    """Another precision computes other KV: the weights' witness (which binds the L3
    namespace) differs, so an int4 reader never reuses what a float32 writer stored, and
    an int4 reader reuses what an int4 writer stored."""
    from engine_checks import greedy
    from uniradix.engine import Engine
    from uniradix.hicache.backends.file import FileBackend
    from uniradix.model.fingerprint import weights_fingerprint, weights_witness
    from uniradix.model.hf import load_checkpoint
    path = tiny("qwen3")
    loads = {p: functools.partial(load_checkpoint, path, *p) for p in
             [(torch.float32, "none"), (torch.bfloat16, "none"), (torch.float32, "int8"),
              (torch.float32, "int4"), (torch.bfloat16, "int4")]}
    assert len({weights_witness(load().weights) for load in loads.values()}) == len(loads)
    assert len({weights_fingerprint(load().weights) for load in list(loads.values())[2:]}) == 3
    moved = loads[(torch.float32, "int4")]().to("cpu")
    assert weights_witness(moved.weights) == weights_witness(loads[(torch.float32, "int4")]().weights)
    ids = toks(random.Random(5), 40)

    def reuse(writer, reader) -> int:
        store = FileBackend(str(tmp_path / f"l3-{writer}-{reader}"))
        w = Engine(loads[writer](), page_size=4, storage=store, prefetch_threshold=1)
        w.run([greedy(ids, 2)])
        r = Engine(loads[reader](), page_size=4, storage=store, prefetch_threshold=1)
        req = greedy(ids + [9, 10, 11], 2)
        r.run([req])
        w.close()
        r.close()
        return req.metrics.storage_tokens

    assert reuse((torch.float32, "none"), (torch.float32, "int4")) == 0
    assert reuse((torch.float32, "int4"), (torch.float32, "int4")) > 0


def test_load_and_flags(tiny, capsys):
    from uniradix.cli import main
    from uniradix.config import ModelSettings
    from uniradix.model.hf import load_checkpoint
    assert ModelSettings().quantization == "none"
    with pytest.raises(ValueError, match="int3"):
        load_checkpoint(tiny("qwen3"), quantization="int3")
    with pytest.raises(ValueError, match="already quantized"):
        load_checkpoint(tiny("qwen3"), quantization="int8").quantize("int4")
    run = ["run", "--clients", "1", "--rounds", "1", "--tokens-per-round", "8", "--output-tokens", "2",
           "--shared-prefix-tokens", "0", "--no-progress"]
    with pytest.raises(SystemExit):
        main([*run, "--quantization", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
    assert main([*run, "--quantization", "int8"]) == 2  # the embedded model has no checkpoint to quantize
    assert "--quantization int8 applies to a checkpoint" in capsys.readouterr().err
    assert main([*run, "--model-path", tiny("gemma3"), "--dtype", "bfloat16", "--quantization", "int4"]) == 0
    assert "gemma3_text from" in (out := capsys.readouterr().out) and "in bfloat16, int4 linear weights" in out


def test_a_quantized_tiny_vocabulary_head_stays_exact(tiny, make_engine):
    """The head (here 512 x 64) goes through the same kernels as every projection, and
    a tied head is quantized as its own copy: the embedding the lookup reads is the
    checkpoint's."""
    from engine_checks import greedy, run_checked
    from harness import check_close
    from uniradix.model.hf import load_checkpoint
    path = tiny("gemma3")
    model = load_checkpoint(path, quantization="int4")
    dense = load_checkpoint(path)
    assert torch.equal(model.w(model.embed_weight), dense.w(dense.embed_weight))
    assert model.lm_head.shape == (V, 64)
    eng = make_engine(model, page_size=4, chunked_prefill_size=5)
    reqs = [greedy(toks(random.Random(i), 23), 5) for i in range(3)]
    run_checked(eng, reqs)
    for r in reqs:
        check_close(eng, r, model.reference, 0.1)


def test_the_precision_benchmark_runs(tiny, tmp_path):
    """benchmarks/precision.py (the precision table in docs/models.md) in a tiny dry run."""
    import importlib.util

    from harness import ROOT
    spec = importlib.util.spec_from_file_location("precision_bench", ROOT / "benchmarks" / "precision.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--model-path", tiny("gemma3"), "--precisions", "float32:none,bfloat16:int4",
                       "--prompts", "2", "--continue", "3", "--prompt", "16", "--decode", "2", "--repeats", "1",
                       "--json", str(tmp_path / "rows.json")])
    assert [(r["dtype"], r["quantization"]) for r in rows] == [("float32", "none"), ("bfloat16", "int4")]
    assert rows[0]["max_logit_diff"] < 1e-3 and rows[0]["greedy_agreement"] == 1.0
    assert rows[0]["same_continuations"] == 2 and rows[1]["max_logit_diff"] > 0
    assert all(r["prefill_tok_s"] > 0 and r["decode_ms"] > 0 for r in rows)


def test_float16_keeps_the_residual_stream_in_float32(tiny):
    """Gemma 3's residual stream outgrows float16 (the real 270M reaches 1e5 by its 8th
    layer; float16 ends at 65504, and transformers' float16 forward gives inf there):
    under float16 the hidden states between blocks stay float32, each block computing
    in float16 from its normed input. Here the post-MLP norms scale each block's output
    to ~1e5."""
    from uniradix.model.hf import load_checkpoint
    path = tiny("gemma3")
    ids = toks(random.Random(6), 30)
    out = {}
    for dtype in (torch.float32, torch.float16):
        m = load_checkpoint(path, dtype)
        for i in range(len(m.kinds)):
            name = f"model.layers.{i}.post_feedforward_layernorm.weight"
            m.weights[name] = (m.weights[name].float() + 3e4).to(dtype)
        assert m.residual_dtype == torch.float32
        out[dtype] = m.reference(ids)
    assert torch.isfinite(out[torch.float16]).all()
    assert (out[torch.float16] - out[torch.float32]).abs().max().item() < 0.05
    assert load_checkpoint(path, torch.bfloat16).residual_dtype == torch.bfloat16  # float32's range: no need


# ---------------------------------------------------------------------------- packed weights
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", ["gemma3", "qwen3_next", "gpt_oss", "nemotron_h"])
def test_every_product_goes_through_the_row_invariant_kernels(tiny, family, dtype):
    """At load every linear weight, router, expert stack and the head (a tied one as a
    copy of its own) is packed for the kernels, whatever its size and dtype; the packed
    weights hold the dense values (the witness reads them back alike)."""
    from uniradix.model import kernels, weights_witness
    from uniradix.model.hf import load_checkpoint
    if not kernels.available():
        pytest.skip(kernels.describe())
    model = load_checkpoint(tiny(family), dtype)
    for name, w in model.weights.items():
        if name == model.embed_weight or not isinstance(w, torch.Tensor):
            continue
        multiplied = w.is_floating_point() and ((w.dim() == 2 and name.endswith(".weight")) or name.endswith(
            model.expert_stacks))
        assert not multiplied, f"{name} {tuple(w.shape)} was left dense"
    assert isinstance(model.lm_head, kernels.PackedWeight) and model.lm_head.dtype == dtype
    packed = [w for w in model.weights.values() if isinstance(w, (kernels.PackedWeight, kernels.PackedExperts))]
    assert packed and all(w.dtype == dtype for w in packed)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernels, "available", lambda: False)
        m.setattr("uniradix.model.hf.gemm.PACK_MIN_ELEMENTS", 1 << 40)
        plain = load_checkpoint(tiny(family), dtype)
    assert weights_witness(model.weights) == weights_witness(plain.weights)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next", "gpt_oss", "granite_hybrid"])
def test_onednn_packed_linears_stay_within_the_bound_without_the_kernels(tiny, family, monkeypatch, make_engine,
                                                                         tmp_path):
    """Without the kernels, on the CPU linears go through oneDNN's packed weights where
    it multiplies the dtype fast (float32 here; the tiny weights are below
    gemm.PACK_MIN_ELEMENTS, so the floor goes to 0): every tier check holds, against
    transformers in float32 and within the bound of the no-cache forward."""
    from uniradix.model import kernels, weights_witness
    from uniradix.model.hf import gemm, load_checkpoint
    monkeypatch.setattr(kernels, "available", lambda: False)
    dense = load_checkpoint(tiny(family))
    monkeypatch.setattr(gemm, "PACK_MIN_ELEMENTS", 0)
    if not gemm.packable(torch.zeros(2, 2)):
        pytest.skip("this CPU's oneDNN has no float32 product")
    model = load_checkpoint(tiny(family))
    packed = [n for n in model.linear_weights() if model.weights[n].layout == torch._mkldnn]
    assert packed and model.lm_head.layout == torch._mkldnn
    assert all(dense.weights[n].layout == torch.strided for n in packed)
    assert weights_witness(model.weights) == weights_witness(dense.weights)
    family_checks(tiny(family), make_engine, tmp_path, 4)
