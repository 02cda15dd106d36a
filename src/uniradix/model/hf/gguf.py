"""A GGUF file (llama.cpp's format) as a Checkpoint, with the `gguf` library and no
`transformers`: its metadata becomes a Hugging Face config dict, every tensor is
dequantized to float32 (then cast) and renamed to the Hugging Face name the family reads,
with what llama.cpp's converter did to it undone, and the SentencePiece-style vocabulary
in `tokenizer.ggml.*` becomes a `tokenizers` object that encodes as transformers' own
GGUF tokenizer does.

Gemma 3 (text) is the architecture read today. What its GGUF files do not state is
filled in as llama.cpp fills it in: five sliding-window layers to one full one, a local
RoPE base of 10000, and queries scaled by 1/sqrt(head_dim) (1/sqrt(hidden/heads) on the
62-layer 27B). llama.cpp's converter stores every Gemma RMSNorm weight as 1 + w; the
family's norms take w, so 1 is subtracted here."""
from __future__ import annotations

import os
import re

import numpy as np
import torch

from ...progress import progress
from .checkpoint import Checkpoint
from .config_forms import FULL, SLIDING

#: GGUF tensor names (blk.N.<part>) -> Hugging Face names, per architecture
_GEMMA3_BLOCK = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA3_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")

SUPPORTED = ("gemma3",)
#: llama.cpp treats these as end of generation too (besides eos); Gemma's turn end is one
_END_OF_TURN = ("<end_of_turn>",)


def read_gguf(path: str, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Read a .gguf file: config, dequantized tensors (cast to `dtype`), tokenizer."""
    reader = _reader(path)
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED)}")
    names = [t.name for t in reader.tensors]
    config = _gemma3_config(meta, names)
    tensors, bits, blocks = {}, {}, {}
    for t in progress(reader.tensors, f"reading {os.path.basename(path)}"):
        shift = 1.0 if t.name.endswith("norm.weight") else 0.0  # the converter stored 1 + w
        name = _gemma3_name(path, t.name)
        tensors[name] = _tensor(t, dtype, shift)
        bits[name] = _bits_per_weight(t.tensor_type)
        if not shift and len(t.shape) == 2 and t.tensor_type.name not in ("F32", "F16", "BF16", "F64"):
            blocks[name] = (t.tensor_type.name, t.data, tuple(int(d) for d in reversed(t.shape)))
    tok = _tokenizer(meta) if meta.get("tokenizer.ggml.tokens") is not None else None
    generation = {k: config[k] for k in ("bos_token_id", "pad_token_id") if config.get(k) is not None}
    eos = _eos_ids(meta, config)
    if eos:
        generation["eos_token_id"] = eos
    return Checkpoint(path, config, tensors, (path,), generation, tok, stored_bits=bits, stored_blocks=blocks)


# ---------------------------------------------------------------------------- metadata
def _reader(path: str):
    """gguf.GGUFReader over a plain ndarray view of the file's memory map: the reader
    slices the file once per vocabulary entry, and numpy's memmap subclass costs ~6x on
    each slice (28 s against 4 s for Gemma 3's 262k tokens). The view shares the map."""
    from gguf import GGUFReader
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        hint = " (a Git LFS pointer: fetch the file itself)" if head == b"vers" else ""
        raise ValueError(f"{path} is not a GGUF file: it starts with {head!r}, a GGUF file with b'GGUF'{hint}")

    class Reader(GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray)

    return Reader(path)


class _Metadata:
    """The file's key/value metadata, each value read on first use (the vocabulary arrays
    are large)."""

    def __init__(self, reader) -> None:
        self.fields = reader.fields
        self._cache: dict = {}

    def get(self, key: str, default=None):
        if key not in self.fields:
            return default
        if key not in self._cache:
            self._cache[key] = self.fields[key].contents()
        return self._cache[key]

    def __contains__(self, key: str) -> bool:
        return key in self.fields


def _gemma3_config(meta: _Metadata, tensor_names: list[str]) -> dict:
    a = "gemma3"

    def key(name, default=None, required=True):
        v = meta.get(f"{a}.{name}")
        if v is None and required and default is None:
            raise ValueError(f"GGUF metadata has no {a}.{name}")
        return default if v is None else v

    n = int(key("block_count"))
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv = key("attention.head_count_kv")
    if isinstance(kv, list):  # per-layer counts: one value is all the family takes
        if len(set(kv)) != 1:
            raise ValueError(f"GGUF {a}.attention.head_count_kv differs across layers ({kv}); not supported")
        kv = kv[0]
    head_dim = int(key("attention.key_length", hidden // heads))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size", required=False)
    if vocab is None:
        vocab = len(tokens) if tokens is not None else None
    if vocab is None:
        raise ValueError("GGUF metadata gives neither gemma3.vocab_size nor tokenizer.ggml.tokens")
    # which layers slide: an explicit pattern (a period, or one flag per layer, true = sliding), else
    # Gemma 3's own rule (and llama.cpp's): every sixth layer is full
    pattern = key("attention.sliding_window_pattern", required=False)
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise ValueError(f"GGUF {a}.attention.sliding_window_pattern has {len(pattern)} flags for {n} layers")
        kinds = [SLIDING if p else FULL for p in pattern]
    else:
        period = 6 if pattern is None else int(pattern)
        kinds = [SLIDING if period == 0 or i % period < period - 1 else FULL for i in range(n)]
    scale = key("attention.scale", required=False)
    if scale is not None:
        qpas = float(scale) ** -2
    else:  # llama.cpp: 1/sqrt(hidden/heads) on the 27B (62 layers), 1/sqrt(head_dim) otherwise
        qpas = hidden // heads if n == 62 else head_dim
    config = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "_name_or_path": meta.get("general.name", ""),
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length", 131072)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": float(key("rope.freq_base_swa", 10_000.0)),
        "sliding_window": int(key("attention.sliding_window", 4096)),
        "layer_types": kinds,
        "query_pre_attn_scalar": qpas,
        "attn_logit_softcapping": key("attn_logit_softcapping", required=False),
        "final_logit_softcapping": key("final_logit_softcapping", required=False),
        "hidden_activation": "gelu_pytorch_tanh",
        # llama.cpp writes the output projection only when it is not the embedding
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    rope_type = key("rope.scaling.type", required=False)
    if rope_type not in (None, "none"):  # the full layers' scaling (Gemma 3 4B+: linear, 8)
        config["rope_scaling"] = {"rope_type": rope_type, "factor": float(key("rope.scaling.factor"))}
    for name, k in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        v = meta.get(f"tokenizer.ggml.{k}")
        if v is not None:
            config[name] = int(v)
    return config


def _eos_ids(meta: _Metadata, config: dict) -> list[int]:
    """eos, the file's end-of-turn id, and Gemma's <end_of_turn> (what llama.cpp stops at,
    and Gemma 3's generation_config.json lists)."""
    out = [config["eos_token_id"]] if config.get("eos_token_id") is not None else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None:
        out.append(int(eot))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    for i, t in enumerate(tokens[:1024]):  # the control tokens sit at the front of Gemma's vocabulary
        if t in _END_OF_TURN:
            out.append(i)
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------- tensors
def _gemma3_name(path: str, name: str) -> str:
    m = _BLOCK.match(name)
    if m:
        part = _GEMMA3_BLOCK.get(m.group(2))
        if part is not None:
            return f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    else:
        base, _, suffix = name.rpartition(".")
        if base in _GEMMA3_TOP:
            return f"{_GEMMA3_TOP[base]}.{suffix}"
    raise ValueError(f"{path}: GGUF tensor {name!r} has no Gemma 3 counterpart")


def _bits_per_weight(tensor_type) -> float:
    """Bits a tensor of this GGML type stores per weight (Q4_K: 4.5, Q8_0: 8.5, F32: 32)."""
    from gguf import GGML_QUANT_SIZES
    block, nbytes = GGML_QUANT_SIZES[tensor_type]
    return 8 * nbytes / block


def _tensor(t, dtype: torch.dtype, norm_shift: float = 0.0) -> torch.Tensor:
    """One tensor dequantized to float32, in the Hugging Face layout ([out, in]: GGUF lists
    dimensions innermost first), less `norm_shift`, cast to `dtype`."""
    from gguf.quants import dequantize
    shape = tuple(int(d) for d in reversed(t.shape))
    arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True).reshape(shape)
    x = torch.from_numpy(arr)
    if norm_shift:
        x = x - norm_shift
    return x.to(dtype)


# ---------------------------------------------------------------------------- tokenizer
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _tokenizer(meta: _Metadata):
    """The vocabulary as transformers' GGUF path builds it for Gemma (GemmaTokenizer over
    the file's tokens): a byte-fallback BPE whose merges are read off the vocabulary in
    file order, spaces written as U+2581, control tokens special and user-defined ones
    (newline runs, ...) kept whole, bos added before the text when the file says so."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    from .tokenizer import HFTokenizer
    model = meta.get("tokenizer.ggml.model")
    if model != "llama":
        raise ValueError(f"GGUF tokenizer {model!r} is not supported for Gemma (expected a SentencePiece "
                         "'llama' vocabulary)")
    raw = list(meta.get("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(raw))
    # Gemma files store tokens of two or more spaces as real spaces; the model spells them U+2581
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in raw]
    vocab = {t: i for i, t in enumerate(tokens)}

    def text(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return None if i is None else raw[int(i)]

    unk = text("unknown_token_id") or "<unk>"
    tok = Tokenizer(BPE(vocab=vocab, merges=_merges(tokens, vocab), fuse_unk=True, unk_token=unk,
                        dropout=None, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = {"bos_token": text("bos_token_id"), "eos_token": text("eos_token_id"), "unk_token": unk,
                "pad_token": text("padding_token_id")}
    control = [t for t, ty in zip(raw, types) if ty == CONTROL]
    control += [t for t in specials.values() if t is not None and t not in control]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    # user-defined tokens that are in the vocabulary as written (the space runs are not)
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(raw, types) if ty == USER_DEFINED and t in vocab])
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_bos = True if add_bos is None else bool(add_bos)  # a SentencePiece vocabulary adds bos unless told
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = specials["bos_token"], specials["eos_token"]
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=([(bos, vocab[bos])] if add_bos else []) + ([(eos, vocab[eos])] if add_eos else []))
    settings = {k: v for k, v in specials.items() if v is not None}
    settings.update(add_bos_token=add_bos, add_eos_token=add_eos)
    template = meta.get("tokenizer.chat_template")
    if not isinstance(template, str):
        # a file without a template gets Gemma's turn format when its vocabulary has the turn
        # tokens (llama.cpp picks its built-in template the same way)
        template = _GEMMA_TURNS if all(t in vocab for t in ("<start_of_turn>", "<end_of_turn>")) else None
    return HFTokenizer(tok, settings, template)


#: Gemma's chat format: turns of user and model; a system message opens the first user turn
_GEMMA_TURNS = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def _merges(tokens: list[str], vocab: dict) -> list[tuple[str, str]]:
    """Every (left, right) split of a token whose halves are tokens too, best first: in
    the order the merged tokens appear in the file, and for one token the longer left half
    first. (What transformers' generate_merges gives with file positions as the scores,
    without its sort.)"""
    out = []
    for i, t in enumerate(tokens):
        if vocab[t] != i:  # a repeated token ranks where it is last, as in the vocabulary
            continue
        for k in range(len(t) - 1, 0, -1):
            left, right = t[:k], t[k:]
            if left in vocab and right in vocab:
                out.append((left, right))
    return out
