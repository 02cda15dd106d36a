"""Gemma 3 (text): sliding-window and full attention layers (five to one), each with
QK-norm, RoPE bases per layer kind, (1 + w) RMSNorms before and after attention and the
MLP, the embedding scaled by sqrt(hidden), GELU-tanh MLPs, optional soft-capping."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .checkpoint import rope_parameters
from .family import HFModel
from .ops import apply_rope, paged_attention, rms_norm, rope_cos_sin, rope_inv_freq


class Gemma3(HFModel):
    model_types = ("gemma3_text", "gemma3")

    def __init__(self, ckpt, dtype=torch.float32) -> None:
        super().__init__(ckpt, dtype)
        c = self.config
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.scale = c.get("query_pre_attn_scalar", self.head_dim) ** -0.5
        # attn_logit_softcapping is not read: Gemma 3 replaced Gemma 2's score capping with
        # QK-norm, and transformers' Gemma3Attention never applies it
        self.final_softcap = c.get("final_logit_softcapping")
        self.rope = {kind: rope_inv_freq(rope_parameters(c, kind), self.head_dim, c.get("max_position_embeddings"))
                     for kind in set(self.kinds)}
        self.lm_head = self.tied_head()

    def embed(self, ids):
        e = self.w("model.embed_tokens.weight")
        scale = torch.tensor(self.config["hidden_size"] ** 0.5).to(e.dtype)
        return e[ids] * scale

    def block(self, i, x, batch):
        p = f"model.layers.{i}."
        w = self.w
        N = x.shape[0]
        h = rms_norm(x, w(p + "input_layernorm.weight"), self.eps, 1.0)
        q = (h @ w(p + "self_attn.q_proj.weight").t()).view(N, self.heads, self.head_dim)
        k = (h @ w(p + "self_attn.k_proj.weight").t()).view(N, self.kv_heads, self.head_dim)
        v = (h @ w(p + "self_attn.v_proj.weight").t()).view(N, self.kv_heads, self.head_dim)
        q = rms_norm(q, w(p + "self_attn.q_norm.weight"), self.eps, 1.0)
        k = rms_norm(k, w(p + "self_attn.k_norm.weight"), self.eps, 1.0)
        inv, scaling = self.rope[self.kinds[i]]
        cos, sin = rope_cos_sin(batch.pos, inv, scaling, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = paged_attention(batch, self.spec(i), i, q, k, v, scale=self.scale)
        a = a.reshape(N, -1) @ w(p + "self_attn.o_proj.weight").t()
        x = x + rms_norm(a, w(p + "post_attention_layernorm.weight"), self.eps, 1.0)
        h = rms_norm(x, w(p + "pre_feedforward_layernorm.weight"), self.eps, 1.0)
        g = F.gelu(h @ w(p + "mlp.gate_proj.weight").t(), approximate="tanh")
        m = (g * (h @ w(p + "mlp.up_proj.weight").t())) @ w(p + "mlp.down_proj.weight").t()
        return x + rms_norm(m, w(p + "post_feedforward_layernorm.weight"), self.eps, 1.0)

    def head(self, x):
        logits = rms_norm(x, self.w("model.norm.weight"), self.eps, 1.0) @ self.lm_head.t()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
