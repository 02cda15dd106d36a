"""Qwen3 (dense): full attention with QK-norm (per head), RoPE, SwiGLU MLPs, Llama-style
RMSNorms. The control of the hybrid families: only FULL (and SWA) state.

Sliding-window layers, as Qwen3Config reads them: `layer_types`, else every layer from
`max_window_layers` on when `use_sliding_window` is set; the window is `sliding_window`
only where `use_sliding_window` is set (the released configs: no sliding layers)."""
from __future__ import annotations

import torch

from .config_forms import FULL, SLIDING, ConfigError, layer_count
from .family import HFModel
from .ops import gated, linear, paged_attention, rms_norm_llama

#: Qwen3Config's defaults (transformers 5.24) for the keys read here
DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "use_sliding_window": False, "sliding_window": 4096,
    "max_window_layers": 28, "tie_word_embeddings": False,
}


class Qwen3(HFModel):
    model_types = ("qwen3",)
    defaults = {"qwen3": DEFAULTS}
    nullable = HFModel.nullable + ("num_key_value_heads",)  # Qwen3Config: as many as the query heads
    layer_kinds = (FULL, SLIDING)
    partial_rotary = False

    @classmethod
    def derive_kinds(cls, c):
        window = c["sliding_window"] if c["use_sliding_window"] else None
        return [SLIDING if window is not None and i >= c["max_window_layers"] else FULL
                for i in range(layer_count(c))]

    @classmethod
    def read_window(cls, c, i, kind):
        if kind == SLIDING and not c["use_sliding_window"]:
            raise ConfigError("use_sliding_window", f"is false, so layer {i} (sliding_attention) has no window")
        return super().read_window(c, i, kind)

    @classmethod
    def check_config(cls, c):
        super().check_config(c)
        if c.get("hidden_act") != "silu":
            raise ConfigError("hidden_act", f"{c.get('hidden_act')!r} is not supported (silu)")

    def __init__(self, ckpt, dtype=torch.float32) -> None:
        super().__init__(ckpt, dtype)
        self.eps = self.config["rms_norm_eps"]

    def embed(self, ids):
        return self.w("model.embed_tokens.weight")[ids]

    def block(self, i, x, batch):
        p = f"model.layers.{i}."
        w, N = self.w, x.shape[0]
        h = rms_norm_llama(x, w(p + "input_layernorm.weight"), self.eps, dtype=self.dtype)
        q, k, v = self.projections(h, p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj")
        q = q.view(N, self.heads, self.head_dim)
        k, v = k.view(N, self.kv_heads, self.head_dim), v.view(N, self.kv_heads, self.head_dim)
        q = rms_norm_llama(q, w(p + "self_attn.q_norm.weight"), self.eps)
        k = rms_norm_llama(k, w(p + "self_attn.k_norm.weight"), self.eps)
        q, k = batch.rotate(self.rope[i], q, k)
        a = paged_attention(batch, self.spec(i), i, q, k, v, scale=self.head_dim ** -0.5)
        x = batch.kept(x) + self._linear(a.flatten(1), p + "self_attn.o_proj")
        h = rms_norm_llama(x, w(p + "post_attention_layernorm.weight"), self.eps, dtype=self.dtype)
        g, u = self.projections(h, p + "mlp.gate_proj", p + "mlp.up_proj")
        g = gated("silu", g, u)
        return x + linear(g, w(p + "mlp.down_proj.weight"))

    def final_norm(self, x):
        return rms_norm_llama(x, self.w("model.norm.weight"), self.eps, dtype=self.dtype)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W^T (+ bias where the checkpoint has one: attention_bias)."""
        return linear(x, self.w(name + ".weight"), self.weights.get(name + ".bias"))
