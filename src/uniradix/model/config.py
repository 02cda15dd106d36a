"""The reference hybrid model's shape: a layer pattern over F, S and M, and presets
that mirror real layouts at a size a laptop CPU runs."""
from __future__ import annotations

from dataclasses import dataclass, replace

LAYER_KINDS = {"F": "full attention", "S": "sliding-window attention", "M": "recurrent (gated delta)"}


@dataclass(frozen=True)
class HybridConfig:
    """pattern: one letter per layer (F, S, M). Attention uses grouped-query heads and
    RoPE; S attends to the last `window` tokens; M is a short causal depthwise conv
    (kernel `conv_kernel`, its own state) feeding a per-head recurrent state of
    `state_dim` x `head_dim`, updated per token."""

    pattern: str = "FSMF"
    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    window: int = 16
    conv_kernel: int = 4
    state_dim: int = 16
    mlp_hidden: int = 128
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        bad = sorted(set(self.pattern) - set(LAYER_KINDS))
        if not self.pattern or bad:
            raise ValueError(f"pattern must be a non-empty string over {''.join(LAYER_KINDS)}, got {self.pattern!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "window",
                     "conv_kernel", "state_dim", "mlp_hidden"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def layers(self, kind: str) -> list[int]:
        """Indices of the layers of one kind."""
        return [i for i, k in enumerate(self.pattern) if k == kind]

    def with_(self, **changes) -> "HybridConfig":
        return replace(self, **changes)


PRESETS: dict[str, HybridConfig] = {
    # every kind of layer, tiny: the default
    "tiny-hybrid": HybridConfig(pattern="FSMF"),
    # Qwen3-Next: three linear-attention (recurrent) layers to one full attention layer
    "qwen3-next-like": HybridConfig(pattern="MMMF" * 2),
    # gpt-oss: sliding-window and full attention alternating
    "gpt-oss-like": HybridConfig(pattern="SF" * 3),
    # Gemma 3: five local (sliding) layers to one global
    "gemma3-like": HybridConfig(pattern="SSSSSF"),
    # Jamba: seven Mamba layers to one attention layer
    "jamba-like": HybridConfig(pattern="MMMMMMMF"),
    # single-kind references, for the benchmarks' F-only / F+S / F+M rows
    "full-only": HybridConfig(pattern="FF"),
}


def preset(name: str) -> HybridConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
