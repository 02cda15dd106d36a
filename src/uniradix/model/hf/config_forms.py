"""config.json in every form a family has shipped in, read into one: each layer's kind,
sliding window and RoPE setup (`Layer`), and the config with the family's defaults
filled in.

Released configs differ from what today's `save_pretrained` writes: Gemma 3 marks its
layers with `sliding_window_pattern` and gives RoPE as `rope_theta` /
`rope_local_base_freq` / `rope_scaling`; Qwen3-Next with `full_attention_interval`;
Nemotron-H with `hybrid_override_pattern`; multimodal wrappers carry a sparse
`text_config` that relies on the text config class's defaults. Each family states, on
its HFModel class, what its transformers config class does with those keys (its
defaults, its legacy key names, how it derives the kinds when `layer_types` is absent,
its RoPE per kind); the helpers here are the pieces those statements are made of.

What the forward cannot express (a RoPE type it lacks, a layer kind or pattern character
it does not know, a sliding layer with no window, keys that contradict each other) is
refused with the key named: a silent fallback would run and compute another model."""
from __future__ import annotations

import os

from dataclasses import dataclass

#: one name per layer kind, whatever a family's config calls it
FULL, SLIDING, LINEAR, MLP, MOE, HYBRID = ("full_attention", "sliding_attention", "linear_attention", "mlp", "moe",
                                           "hybrid")

#: the names configs use for the kinds (transformers maps the legacy `mamba` and `attention` the same way)
KIND_NAMES = {"full_attention": FULL, "attention": FULL, "sliding_attention": SLIDING,
              "linear_attention": LINEAR, "mamba": LINEAR, "mlp": MLP, "moe": MOE, "hybrid": HYBRID}

#: the RoPE types ops.rope_inv_freq computes
ROPE_TYPES = ("default", "linear", "yarn")


class ConfigError(ValueError):
    """config.json asks for something this loader cannot serve; `key` names where."""

    def __init__(self, key: str, why: str, where: str = "config.json") -> None:
        super().__init__(f"{where} `{key}`: {why}")
        self.key, self.why = key, why


@dataclass(frozen=True)
class Layer:
    """One layer as the forward and the cache see it. `window`: keys a query reads (itself
    included) on a sliding layer, else None. `rope`: the RoPE setup (rope_type,
    rope_theta, partial_rotary_factor, factor, ...) as ops.rope_inv_freq takes it, None
    where the layer has no RoPE."""

    kind: str
    window: int | None = None
    rope: dict | None = None


# ---------------------------------------------------------------------------- defaults
def with_defaults(config: dict, defaults: dict, aliases: dict, nullable: tuple = ()) -> dict:
    """A copy of `config` with legacy keys renamed (`aliases`: legacy -> current; the
    legacy key wins where present, as the config classes read it) and every missing key of
    `defaults` filled in. A key given as null where its default is a value is refused (as
    transformers' typed config fields refuse it), unless it is `nullable`: null means
    something there (no window, KV heads as many as query heads)."""
    out = dict(config)
    named = {current: legacy for legacy, current in aliases.items() if legacy in out}
    for legacy, current in aliases.items():
        if legacy in out:
            out[current] = out.pop(legacy)
    for k, v in defaults.items():
        if k in out and out[k] is None and v is not None and k not in nullable:
            raise ConfigError(named.get(k, k), f"is null; give a value (the config class's default is {v!r})")
        out.setdefault(k, v)
    return out


# ---------------------------------------------------------------------------- layer kinds
def listed_kinds(config: dict, keys: tuple) -> tuple[list[str], str] | None:
    """The kinds from the first of `keys` the config gives (a list of names), and that key;
    None where it gives none. Two keys that disagree are refused."""
    found = [(k, config[k]) for k in keys if config.get(k) is not None]
    if not found:
        return None
    key, names = found[0]
    if not isinstance(names, (list, tuple)):
        raise ConfigError(key, f"must be a list of layer kinds, got {names!r:.60}")
    kinds = [kind_name(n, f"{key}[{i}]") for i, n in enumerate(names)]
    for other, more in found[1:]:
        if [kind_name(n, other) for n in more] != kinds:
            raise ConfigError(other, f"disagrees with `{key}`; give one of them")
    return kinds, key


def kind_name(name, key: str) -> str:
    try:
        return KIND_NAMES[name]
    except (KeyError, TypeError):
        raise ConfigError(key, f"unknown layer kind {name!r} (known: {', '.join(sorted(KIND_NAMES))})") from None


def every_nth(config: dict, key: str, default: int, nth: str, other: str) -> list[str]:
    """Layer i is `nth` where (i + 1) is a multiple of the period config[key] (or
    `default`), else `other`: how Gemma 3's `sliding_window_pattern` and Qwen3-Next's
    `full_attention_interval` mark layers."""
    period = config.get(key, default)
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ConfigError(key, f"must be a positive integer (a period in layers), got {period!r}")
    return [other if (i + 1) % period else nth for i in range(layer_count(config))]


def pattern_kinds(config: dict, key: str, chars: dict) -> list[str]:
    """One kind per character of config[key] (Nemotron-H's hybrid_override_pattern)."""
    pattern = config[key]
    if not isinstance(pattern, str):
        raise ConfigError(key, f"must be a string, got {pattern!r:.60}")
    for i, ch in enumerate(pattern):
        if ch not in chars:
            raise ConfigError(key, f"character {ch!r} at {i} is not a layer kind (known: {''.join(chars)})")
    return [chars[ch] for ch in pattern]


def layer_count(config: dict) -> int:
    n = config.get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError("num_hidden_layers", f"must be a positive integer, got {n!r}")
    return n


# ---------------------------------------------------------------------------- RoPE
def single_rope(config: dict, default_theta: float, partial: float | None = None, fallback: dict | None = None,
                partial_rotary: bool = True) -> dict:
    """One RoPE setup for every attention layer, read as transformers' config classes read
    it: `rope_scaling` (legacy) replaces `rope_parameters`, else `rope_parameters`, else
    `fallback` (the class's own default); `rope_theta` (legacy) or `default_theta` and
    `partial_rotary_factor` (legacy) or `partial` fill what the setup lacks."""
    if config.get("rope_scaling"):
        key, params = "rope_scaling", config["rope_scaling"]
    elif config.get("rope_parameters") is not None:
        key, params = "rope_parameters", config["rope_parameters"]
    else:
        key, params = "rope_parameters", fallback or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(key, "must be one RoPE setup (this family has one RoPE for all its attention layers), "
                               f"got {params!r:.80}")
    params = dict(params)
    if (params.get("rope_type") or params.get("type")) == "yarn" and \
            config.get("original_max_position_embeddings") is not None:
        # transformers' exception for one setup (Phi-3's form): the top-level pretraining
        # length wins over the one inside the setup
        params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    params.setdefault("rope_theta", config["rope_theta"] if "rope_theta" in config else default_theta)
    factor = config["partial_rotary_factor"] if "partial_rotary_factor" in config else partial
    if factor is not None:
        params.setdefault("partial_rotary_factor", factor)
    return rope_setup(params, key, config, partial_rotary)


def rope_dict(value, key: str) -> dict:
    """`value` if it is one RoPE setup (a JSON object), else refused naming `key`."""
    if not isinstance(value, dict):
        raise ConfigError(key, f"must be a RoPE setup (an object with rope_type, ...), got {value!r:.60}")
    return value


def rope_setup(params: dict, key: str, config: dict, partial_rotary: bool = True) -> dict:
    """A RoPE setup normalised (rope_type from `type`, YaRN's original length and factor
    filled as transformers fills them) and checked: a type or a value the forward cannot
    compute is refused, naming `key`. `partial_rotary`: False where the family's forward
    rotates the whole head whatever the setup says."""
    p = dict(params)
    kind = p.pop("type", None)
    p.setdefault("rope_type", kind or "default")
    if p["rope_type"] not in ROPE_TYPES:
        raise ConfigError(f"{key}.rope_type", f"RoPE type {p['rope_type']!r} is not supported "
                                              f"({', '.join(ROPE_TYPES)})")
    theta = p.get("rope_theta")
    if not _positive(theta):
        raise ConfigError(f"{key}.rope_theta", f"must be a positive number, got {theta!r}")
    partial = p.get("partial_rotary_factor", 1.0)
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ConfigError(f"{key}.partial_rotary_factor", f"must be in (0, 1], got {partial!r}")
    if partial != 1 and not partial_rotary:
        raise ConfigError(f"{key}.partial_rotary_factor", f"{partial}: this family rotates the whole head")
    if p["rope_type"] == "linear" and not _positive(p.get("factor")):
        raise ConfigError(f"{key}.factor", f"linear RoPE needs a positive factor, got {p.get('factor')!r}")
    if p["rope_type"] == "yarn":
        if p.get("original_max_position_embeddings") is None:
            p["original_max_position_embeddings"] = config.get("max_position_embeddings")
        if not _positive(p["original_max_position_embeddings"]):
            raise ConfigError(f"{key}.original_max_position_embeddings",
                              "YaRN needs the pretraining length (or max_position_embeddings)")
        if p.get("factor") is None:  # transformers: the context extension it was configured for
            p["factor"] = config.get("max_position_embeddings", 0) / p["original_max_position_embeddings"]
        if not _positive(p["factor"]):
            raise ConfigError(f"{key}.factor", f"YaRN needs a positive factor, got {p['factor']!r}")
    return p


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


__all__ = ["FULL", "SLIDING", "LINEAR", "MLP", "MOE", "HYBRID", "KIND_NAMES", "ROPE_TYPES", "ConfigError", "Layer",
           "with_defaults", "listed_kinds", "kind_name", "every_nth", "pattern_kinds", "layer_count", "single_rope",
           "rope_dict", "rope_setup"]


def config_source(path: str) -> str:
    """Where a checkpoint's config came from, for errors: its config.json, or a GGUF
    file's metadata (read into the same keys)."""
    return f"{path}: GGUF metadata" if path.endswith(".gguf") and not os.path.isdir(path) else f"{path}: config.json"
