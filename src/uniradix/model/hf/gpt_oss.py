"""gpt-oss: sliding-window and full attention layers alternating (sliding first), each
with per-head attention sinks, q/k/v/o biases and YaRN RoPE; plain-w RMSNorms (in
float32, weights in float32); a mixture of experts per layer: a biased router, softmax
over its top-k logits, experts with fused gate/up weights [E, in, 2I] (gate and up
interleaved; held [E, 2I, in] here, the layout of every projection) and biases, and a
clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate)).

Expert weights quantized as MXFP4 (`*_blocks` uint8 [E, rows, G, 16], two FP4 values a
byte, low nibble first; `*_scales` uint8 [E, rows, G], the exponent + 127 of each group
of 32) are dequantized at load: every FP4 value times a power of two is exact in float32
(and bfloat16), so the weights are the ones transformers dequantizes."""
from __future__ import annotations


import torch

from .config_forms import FULL, SLIDING, layer_count, single_rope
from .family import HFModel
from .ops import linear, paged_attention, rms_norm, sigmoid

#: the 16 values of an FP4 (E2M1) code, sign bit highest
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "?") -> torch.Tensor:
    """MXFP4 expert weights in float32, laid out as transformers' experts hold them:
    blocks [E, R, G, B] and scales [E, R, G] (as stored) -> [E, G * B * 2, R]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8 (got {blocks.dtype}, {scales.dtype})")
    if blocks.dim() != 4 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [E, rows, groups, bytes] and scales [E, rows, groups])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    E, R, G, B = blocks.shape
    vals = torch.empty(E, R, G, B * 2, dtype=torch.float32, device=blocks.device)
    vals[..., 0::2] = lut[(blocks & 0x0F).long()]
    vals[..., 1::2] = lut[(blocks >> 4).long()]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127)[..., None])
    if not torch.isfinite(vals).all():
        raise ValueError(f"{name}: an MXFP4 scale overflows float32 (exponent above 127)")
    return vals.reshape(E, R, G * B * 2).transpose(1, 2).contiguous()


#: GptOssConfig's defaults (transformers 5.24) for the keys read here
DEFAULTS = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "tie_word_embeddings": False,
}
#: GptOssConfig's RoPE where the config gives none: YaRN x32 over 4096 (theta: 150k)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


class GptOss(HFModel):
    model_types = ("gpt_oss",)
    defaults = {"gpt_oss": DEFAULTS}
    aliases = {"num_experts": "num_local_experts"}
    layer_kinds = (SLIDING, FULL)
    rope_theta_default = 150_000.0
    partial_rotary = False

    @classmethod
    def derive_kinds(cls, c):
        return [SLIDING if (i + 1) % 2 else FULL for i in range(layer_count(c))]

    @classmethod
    def read_rope(cls, c):
        rope = single_rope(c, cls.rope_theta_default, fallback=DEFAULT_ROPE, partial_rotary=False)
        return {FULL: rope, SLIDING: rope}

    def expected_shapes(self):
        out = super().expected_shapes()
        for i in range(len(self.kinds)):
            out[self.attention_prefix(i) + "sinks"] = ((self.heads,), "num_attention_heads")
        return out

    def __init__(self, ckpt, dtype=torch.float32) -> None:
        super().__init__(ckpt, dtype)
        c = self.config
        self.eps = c["rms_norm_eps"]
        self.scale = self.head_dim ** -0.5
        self.top_k = c["num_experts_per_tok"]
        self.alpha = c["swiglu_alpha"]
        self.limit = c["swiglu_limit"]
        self.experts = c["num_local_experts"]
        self._dequantize()
        self._experts_out_in()

    def _dequantize(self) -> None:
        """Replace each `<name>_blocks` / `<name>_scales` pair with `<name>` in the model's dtype."""
        for name in [n for n in self.weights if n.endswith("_blocks")]:
            base = name.removesuffix("_blocks")
            scales = self.weights.get(base + "_scales")
            if scales is None:
                raise ValueError(f"{self.ckpt.path}: {name!r} has no {base + '_scales'!r} (MXFP4 needs both)")
            w = dequantize_mxfp4(self.weights.pop(name), self.weights.pop(base + "_scales"), name)
            self.weights[base] = w.to(self.dtype)
        left = [n for n in self.weights if n.endswith("_scales")]
        if left:
            raise ValueError(f"{self.ckpt.path}: {left[0]!r} has no matching '_blocks' tensor")

    def _experts_out_in(self) -> None:
        """The expert stacks as [E, out, in] (checkpoints hold them [E, in, out]): the
        layout of every other projection, which ops.linear and quantization take."""
        for name in [n for n in self.weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            self.weights[name] = self.weights[name].transpose(1, 2).contiguous()

    def embed(self, ids):
        return self.w("model.embed_tokens.weight")[ids]

    def block(self, i, x, batch):
        p = f"model.layers.{i}."
        w = self.w
        N = x.shape[0]
        h = rms_norm(x, w(p + "input_layernorm.weight"), self.eps, dtype=self.dtype)
        q = self._linear(h, p + "self_attn.q_proj").view(N, self.heads, self.head_dim)
        k = self._linear(h, p + "self_attn.k_proj").view(N, self.kv_heads, self.head_dim)
        v = self._linear(h, p + "self_attn.v_proj").view(N, self.kv_heads, self.head_dim)
        q, k = batch.rotate(self.rope[i], q, k)
        a = paged_attention(batch, self.spec(i), i, q, k, v, scale=self.scale, sinks=w(p + "self_attn.sinks"))
        x = batch.kept(x) + self._linear(a.flatten(1), p + "self_attn.o_proj")
        h = rms_norm(x, w(p + "post_attention_layernorm.weight"), self.eps, dtype=self.dtype)
        return x + self.moe(p + "mlp.", h)

    def _linear(self, h, name):
        return linear(h, self.w(name + ".weight"), self.weights.get(name + ".bias"))

    def moe(self, p, h):
        """The router's top-k experts per token, weighted by a softmax over their logits."""
        w = self.w
        logits = linear(h, w(p + "router.weight"), w(p + "router.bias"))
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        weights = top.softmax(-1)
        gate_up, gate_up_b = w(p + "experts.gate_up_proj"), w(p + "experts.gate_up_proj_bias")
        down, down_b = w(p + "experts.down_proj"), w(p + "experts.down_proj_bias")
        # expert by expert, ascending: a token's sum is in the same order whatever tokens
        # come with it
        out = torch.zeros_like(h)
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            y = linear(self._glu(linear(h[tok], gate_up[e], gate_up_b[e])), down[e], down_b[e])
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(h.dtype))
        return out

    def _glu(self, gu):
        """The clamped SwiGLU over interleaved gate/up columns."""
        gate = gu[..., 0::2].clamp(max=self.limit)
        up = gu[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * sigmoid(gate * self.alpha))

    def final_norm(self, x):
        return rms_norm(x, self.w("model.norm.weight"), self.eps, dtype=self.dtype)
