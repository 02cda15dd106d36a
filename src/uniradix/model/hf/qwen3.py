"""Qwen3 (dense): full attention with QK-norm (per head), RoPE, SwiGLU MLPs, Llama-style
RMSNorms; `layer_types` may mark sliding-window layers. The control of the hybrid
families: only FULL (and SWA) state."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .checkpoint import rope_parameters
from .family import HFModel
from .ops import apply_rope, paged_attention, rms_norm_llama, rope_cos_sin, rope_inv_freq


class Qwen3(HFModel):
    model_types = ("qwen3",)

    def __init__(self, ckpt, dtype=torch.float32) -> None:
        super().__init__(ckpt, dtype)
        c = self.config
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.rope = {kind: rope_inv_freq(rope_parameters(c, kind), self.head_dim, c.get("max_position_embeddings"))
                     for kind in set(self.kinds)}
        self.lm_head = self.tied_head()

    def embed(self, ids):
        return self.w("model.embed_tokens.weight")[ids]

    def block(self, i, x, batch):
        p = f"model.layers.{i}."
        w, N = self.w, x.shape[0]
        h = rms_norm_llama(x, w(p + "input_layernorm.weight"), self.eps)
        q = _linear(h, w, p + "self_attn.q_proj").view(N, self.heads, self.head_dim)
        k = _linear(h, w, p + "self_attn.k_proj").view(N, self.kv_heads, self.head_dim)
        v = _linear(h, w, p + "self_attn.v_proj").view(N, self.kv_heads, self.head_dim)
        q = rms_norm_llama(q, w(p + "self_attn.q_norm.weight"), self.eps)
        k = rms_norm_llama(k, w(p + "self_attn.k_norm.weight"), self.eps)
        inv, scaling = self.rope[self.kinds[i]]
        cos, sin = rope_cos_sin(batch.pos, inv, scaling, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = paged_attention(batch, self.spec(i), i, q, k, v, scale=self.head_dim ** -0.5)
        x = x + _linear(a.reshape(N, -1), w, p + "self_attn.o_proj")
        h = rms_norm_llama(x, w(p + "post_attention_layernorm.weight"), self.eps)
        g = F.silu(h @ w(p + "mlp.gate_proj.weight").t()) * (h @ w(p + "mlp.up_proj.weight").t())
        return x + g @ w(p + "mlp.down_proj.weight").t()

    def head(self, x):
        return rms_norm_llama(x, self.w("model.norm.weight"), self.eps) @ self.lm_head.t()


def _linear(x: torch.Tensor, w, name: str) -> torch.Tensor:
    """x @ W^T (+ bias when the checkpoint has one: attention_bias)."""
    y = x @ w(name + ".weight").t()
    try:
        return y + w(name + ".bias")
    except ValueError:
        return y
