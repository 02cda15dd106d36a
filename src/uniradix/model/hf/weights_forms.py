"""A Hugging Face family's weights, in the forms the forward multiplies by: the check at
load that config.json describes them (expected_shapes), the tied head, the move to a
device, the row-invariant kernels' packing, and quantization (torch's int8 / int4, or a
GGUF's blocks as stored). HFModel's half that knows tensors, not the config or the
forward (family.py)."""
from __future__ import annotations

import torch

from ...progress import progress
from .. import kernels
from .config_forms import ConfigError, config_source
from .gemm import is_packed, pack, unpack
from .ops import linears
from .quant import check_scheme, quantize, stored_scheme


def weight_nbytes(w) -> int:
    """What one weight holds in memory, in whatever form it is: a tensor (oneDNN's
    opaque layout too), a packed form (its `nbytes`), a quantized one (the tensors that
    define it)."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    if callable(getattr(w, "nbytes", None)):
        return w.nbytes()
    t = w.tensors()
    return weight_nbytes(t) if isinstance(t, torch.Tensor) else sum(weight_nbytes(x) for x in t.values())


def weights_nbytes(weights: dict) -> int:
    """What a model's weights hold in memory, a weight under two names (a tied head)
    counted once."""
    return sum(weight_nbytes(w) for w in {id(w): w for w in weights.values()}.values())


class HFWeights:
    """HFModel's weights (a mixin: `self.weights`, `self.config`, the attention shape and
    the checkpoint are HFModel's)."""

    #: the token embedding's name in the checkpoint
    embed_weight: str = "model.embed_tokens.weight"
    #: q_proj rows per query head, in head dims (2 where q_proj also gives each head its
    #: output gate, as in Qwen3-Next)
    q_rows_per_head: int = 1

    def attention_prefix(self, i: int) -> str:
        """Where layer i's q/k/v/o projections live in the checkpoint."""
        return f"model.layers.{i}.self_attn."

    def expected_shapes(self) -> dict:
        """{tensor name: (shape, the config keys that give it)} for the tensors whose shape
        config.json determines: the embedding, the head, each attention layer's
        projections and QK-norms. Families add their own (recurrent mixers)."""
        c = self.config
        V, D, H, KV, hd = c["vocab_size"], c["hidden_size"], self.heads, self.kv_heads, self.head_dim
        out = {self.embed_weight: ((V, D), "vocab_size, hidden_size")}
        if "lm_head.weight" in self.weights:
            out["lm_head.weight"] = ((V, D), "vocab_size, hidden_size")
        gate = " (x2: q and its gate)" if self.q_rows_per_head != 1 else ""
        size = "head_dim" if c.get("head_dim") else "(hidden_size / num_attention_heads)"  # attention_shape's rule
        for i in range(len(self.kinds)):
            if self.spec(i) is None:
                continue
            p = self.attention_prefix(i)
            out[p + "q_proj.weight"] = ((self.q_rows_per_head * H * hd, D),
                                        f"num_attention_heads x {size}{gate}, hidden_size")
            out[p + "k_proj.weight"] = ((KV * hd, D), f"num_key_value_heads x {size}, hidden_size")
            out[p + "v_proj.weight"] = ((KV * hd, D), f"num_key_value_heads x {size}, hidden_size")
            out[p + "o_proj.weight"] = ((D, H * hd), f"hidden_size, num_attention_heads x {size}")
            for norm in ("q_norm.weight", "k_norm.weight"):
                if p + norm in self.weights:
                    out[p + norm] = ((hd,), size)
        return out

    def check_weights(self) -> None:
        """Refuse at load a config.json that does not describe its weights (transformers
        refuses such a checkpoint too): served anyway, a wrong head count fails every
        request inside the forward, and a wrong hidden size or vocabulary computes another
        model (Gemma scales its embedding by sqrt(hidden_size)) or indexes past the
        embedding. And a config that unties the head from the embedding
        (`tie_word_embeddings` false, the class's default for most families) needs the
        head's own weights: transformers would start it from random values."""
        where = config_source(self.ckpt.path)
        for name, (shape, keys) in self.expected_shapes().items():
            t = self.weights.get(name)
            if t is None:
                raise ValueError(f"{self.ckpt.path}: no tensor {name!r} in the checkpoint")
            if tuple(t.shape) != tuple(shape):
                raise ConfigError(keys, f"give {name} the shape {tuple(shape)}, the checkpoint's is "
                                        f"{tuple(t.shape)}: the config does not describe these weights", where)
        if "lm_head.weight" not in self.weights and not self.config.get("tie_word_embeddings"):
            raise ConfigError("tie_word_embeddings", f"is {self.config.get('tie_word_embeddings')!r} (a head of "
                                                     "its own), but the checkpoint has no lm_head.weight", where)

    def tied_head(self, embed: str | None = None) -> torch.Tensor:
        """lm_head.weight, or the embedding where the checkpoint ties them (check_weights
        made sure the config allows it; after pack_linears, the embedding's packed copy)."""
        head = self.weights.get("lm_head.weight")
        if head is not None:
            return head
        if embed is None and self._packed_head is not None:
            return self._packed_head
        return self.w(embed or self.embed_weight)

    # ------------------------------------------------------------------ where it runs
    _packed_head = None   # a tied head's packed copy (the embedding stays dense for the lookup)
    #: whether pack_linears packs (False: torch's default GEMM on dense weights, the
    #: baseline benchmarks/engine_ab.py measures against)
    packs = True

    def to(self, device) -> "HFWeights":
        """The weights on `device`; on the CPU, the linear weights packed (pack_linears)."""
        device = torch.device(device)
        if device.type != "cpu":
            self.weights = {k: unpack(v) for k, v in self.weights.items()}
            self._packed_head = None
        super().to(device)
        if device.type == "cpu":
            self.pack_linears()
        return self

    def pack_linears(self) -> "HFWeights":
        """Every dense linear weight, the head, routers and expert stacks included, in the
        form the CPU multiplies it by (gemm.pack: the row-invariant kernels' panels where
        they are built; else oneDNN's layout where this CPU multiplies the dtype fast). The
        values stay the weights' own (the witness reads them back); a tied head gets a
        packed copy of its own. Quantized weights keep their forms."""
        if not self.packs:
            return self
        routers = [n for n, t in self.weights.items() if isinstance(t, torch.Tensor) and t.dim() == 2
                   and t.is_floating_point() and n.endswith(self.dense_weights)] if kernels.available() else []
        for name in progress(self.linear_weights() + routers, "packing weights"):
            self.weights[name] = pack(self.weights[name])
        if "lm_head.weight" not in self.weights and self._packed_head is None:
            head = pack(self.w(self.embed_weight))
            self._packed_head = head if is_packed(head) else None
        return self

    @property
    def lm_head(self):
        """The head's weight as the forward multiplies by it (tied_head: after quantize,
        the head's own quantized copy)."""
        return self.tied_head()

    # ------------------------------------------------------------------ quantization
    #: name endings of the 2-D weights that stay in the model's dtype whatever the
    #: quantization: MoE routers and gates (quantized, they would send tokens to other
    #: experts; they are small)
    dense_weights: tuple = ("router.weight", "router.layer.weight", ".gate.weight", "shared_expert_gate.weight")
    #: name endings of the expert stacks [experts, out, in] (quantized expert by expert)
    expert_stacks: tuple = ("experts.gate_up_proj", "experts.down_proj", "experts.up_proj")

    def linear_weights(self) -> list[str]:
        """The weights the projections multiply by (ops.linear): every 2-D floating-point
        `.weight` but the embedding and `dense_weights`, the head, and the expert stacks."""
        out = []
        for name, t in self.weights.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            if t.dim() == 2 and name.endswith(".weight") and name != self.embed_weight \
                    and not name.endswith(self.dense_weights):
                out.append(name)
            elif t.dim() == 3 and name.endswith(self.expert_stacks):
                out.append(name)
        return out

    def quantize(self, scheme: str) -> "HFWeights":
        """Every linear weight in `scheme`'s form (quant.quantize: weight-only int8 or
        int4, multiplied by torch's kernels). A head tied to the embedding gets its own
        quantized copy under lm_head.weight: the embedding stays dense for the lookup.
        Norms, routers, convolutions and the recurrent layers' parameters stay in the
        model's dtype. "stored": each weight in the scheme nearest the bits the file
        stores it at (quant.stored_scheme: a .gguf's 4-bit types int4, 5- to 8-bit ones
        int8, float ones dense); the tied head follows the embedding's. Where the
        row-invariant kernels run, "stored" reads a .gguf's quantized tensors as the file
        stores them instead (_read_as_stored): the same bits as the float32 model."""
        check_scheme(scheme)
        if scheme == "none" or scheme == self.quantization:
            return self
        if self.quantization != "none":
            raise ValueError(f"{self.ckpt.path}: already quantized as {self.quantization}")
        if scheme == "stored" and self.ckpt.stored_blocks and kernels.available():
            return self._read_as_stored()
        bits = self.ckpt.stored_bits
        if "lm_head.weight" not in self.weights:
            self.weights["lm_head.weight"] = unpack(self.tied_head())
            self._packed_head = None
            if self.embed_weight in bits:
                bits = {**bits, "lm_head.weight": bits[self.embed_weight]}
        for name in progress(self.linear_weights(), f"quantizing ({scheme})"):
            s = stored_scheme(bits.get(name)) if scheme == "stored" else scheme
            self.weights[name] = quantize(unpack(self.weights[name]), s)
        self.quantization = scheme
        return self

    def _read_as_stored(self) -> "HFWeights":
        """`--quantization stored` on the row-invariant kernels: every linear weight the
        file quantized, and the embedding, read in its own blocks (kernels.PackedQuant:
        each weight the float32 value the file's dequantisation gives, ~its bits per
        weight in memory); a tied head is the embedding's very panels, which the lookup
        reads too (no dense copy of the table). Products are the float32 model's chains
        over the same values, so the logits are its, bit for bit, at a quarter to a
        third of the bytes a step reads. A weight in a format not read here keeps its
        dense form (gguf_blocks.decode)."""
        from .gguf_blocks import decode
        blocks = self.ckpt.stored_blocks

        def as_stored(name):
            kind, raw, shape = blocks[name]
            codes = decode(kind, raw, *shape)
            return None if codes is None else kernels.PackedQuant(codes, kind)

        names = set(self.linear_weights())
        if self.embed_weight in blocks:
            names.add(self.embed_weight)
        for name in progress(sorted(names & set(blocks)), "packing as stored"):
            packed = as_stored(name)
            if packed is not None:
                self.weights[name] = packed
        if "lm_head.weight" not in self.weights and isinstance(self.weights.get(self.embed_weight),
                                                               kernels.PackedQuant):
            self.weights["lm_head.weight"] = self.weights[self.embed_weight]  # tied: one table
            self._packed_head = None
        self.quantization = "stored"
        return self

    def projections(self, h: torch.Tensor, *names: str) -> list[torch.Tensor]:
        """h @ W^T (+ its bias where the checkpoint has one) for each linear named (q, k
        and v; gate and up), as one product where the weights can be one (ops.linears)."""
        return linears(h, [self.w(n + ".weight") for n in names], [self.weights.get(n + ".bias") for n in names])

    def w(self, name: str) -> torch.Tensor:
        try:
            return self.weights[name]
        except KeyError:
            raise ValueError(f"{self.ckpt.path}: no tensor {name!r} in the checkpoint") from None

    def has(self, name: str) -> bool:
        return name in self.weights
