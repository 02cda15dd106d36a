"""Every setting, declared once: its type, default, allowed values, check and help.

Settings live in frozen dataclasses, one per concern (the cache, the host tier, shared
storage, the scheduler, the workload); a field made with `setting()` carries what the
CLI needs, so `add_flags` generates the flags (SGLang's names: the field name with
dashes) and `from_args` builds the configs back from them. Every value is checked when a
config is made, whoever makes it (the CLI, `Engine(**settings)`, a test), with a
ValueError that names the flag. Storage-tier settings SGLang takes in
`--hicache-storage-backend-extra-config` (`extra=True`) are read from that JSON, and
the rest of it configures the backend.

Only the standard library: every layer may import this."""
from __future__ import annotations

import argparse
import json
import math
import numbers
import os
from dataclasses import MISSING, dataclass, field, fields, replace

from .redact import HIDDEN, declare_plain, redact_value

# ---------------------------------------------------------------------------- checks
# A check returns None when the value is fine, else what it should be ("an int >= 1").


def finite_number(v) -> bool:
    """A real number (not a bool) that a float holds finitely: NaN, infinities and ints
    too large for a float are not."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def count(lo: int = 1):
    what = "a positive integer" if lo == 1 else f"an int >= {lo}"

    def check(v):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
            return what
        return None
    return check


def number(above: float | None = None, at_least: float | None = None, at_most: float | None = None):
    what = f"> {above:g}" if above is not None else f">= {at_least:g}"
    if at_most is not None:
        what += f" and <= {at_most:g}"

    def check(v):
        if not finite_number(v):
            return f"a finite number {what}"
        if (above is not None and not v > above) or (at_least is not None and not v >= at_least) or \
                (at_most is not None and not v <= at_most):
            return f"a finite number {what}"
        return None
    return check


def text(v):
    return None if isinstance(v, str) and v else "a non-empty string"


def flag_bool(v):
    return None if isinstance(v, bool) else "true or false"


def optional(inner):
    def check(v):
        return None if v is None else inner(v)
    return check


def setting(default, help: str, *, check=None, choices: tuple | None = None, extra: bool = False,
            secret: bool = False, flag: bool = True, metavar: str | None = None, several: bool = False,
            needs: tuple[str, ...] = ()):
    """A config field. `choices`: the allowed values; `check`: see above; `extra`: read
    from the storage extra-config JSON rather than a flag; `secret`: never echoed in a
    message; `flag`: False for settings the API takes but the CLI does not offer;
    `several`: the flag takes one or more values (a tuple); `needs`: what the setting
    takes effect through (names in NEEDS, any one will do): given without it, it is
    refused rather than ignored (EngineConfig.check_in_effect)."""
    return field(default=default, metadata=dict(help=help, check=check, choices=choices, extra=extra,
                                                secret=secret, flag=flag and not extra, metavar=metavar,
                                                several=several, needs=needs))


#: what a setting may need to take effect (`setting(needs=...)`), as a message names it
NEEDS = {"store": "an L3 store (--hicache-storage-backend; an Engine may be given a backend instead)",
         "host": "the host tier (--enable-hierarchical-cache)",
         "selective": "--hicache-write-policy write_through_selective",
         "spec": "speculative decoding (--speculative-algorithm NGRAM, or --speculative-config)"}


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _label(f) -> str:
    if f.metadata.get("extra"):
        return f"--hicache-storage-backend-extra-config: {f.name}"
    return flag_name(f.name)


def check_fields(cfg) -> None:
    """Check every setting of a config instance; ValueError naming the flag."""
    for f in fields(cfg):
        md = f.metadata
        if "help" not in md:
            continue
        v = getattr(cfg, f.name)
        choices = md.get("choices")
        if choices is not None and v not in choices:
            raise ValueError(f"{_label(f)} must be one of {', '.join(map(str, choices))}, got {v!r}")
        check = md.get("check")
        want = check(v) if check is not None else None
        if want:
            shown = HIDDEN if md.get("secret") else repr(redact_value("", v))  # declared: not by name
            raise ValueError(f"{_label(f)} must be {want}, got {shown}")
        # numpy scalars and the like become plain Python numbers (the tree's arithmetic is hot)
        if isinstance(v, numbers.Integral) and not isinstance(v, bool) and type(v) is not int:
            object.__setattr__(cfg, f.name, int(v))
        elif isinstance(v, numbers.Real) and not isinstance(v, (bool, numbers.Integral)) and type(v) is not float:
            object.__setattr__(cfg, f.name, float(v))


class Settings:
    """Mixin: checks on creation, and the settings as a flat dict."""

    def __post_init__(self) -> None:
        check_fields(self)
        self.check()
        declare_plain_settings(type(self))

    def check(self) -> None:
        """Rules that tie several settings together."""

    def as_dict(self) -> dict:
        """The settings as a server reports them: those declared secret hidden, and the
        secrets inside the extra-config JSON and any other text masked (uniradix.redact;
        a declared setting is shown by what it declares, not judged by its name)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.metadata.get("secret") and v:
                v = HIDDEN
            elif f.name == "hicache_storage_backend_extra_config" and v:
                v = redact_extra_config(v)
            else:
                v = redact_value("", v)
            out[f.name] = v
        return out


# ---------------------------------------------------------------------------- allowed values
EVICTION_POLICIES = ("lru", "lfu", "fifo", "priority")
SWA_RETENTIONS = ("spare", "windows")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
STORAGE_BACKENDS = ("file", "redis", "mooncake", "dynamic")


# ---------------------------------------------------------------------------- the configs
@dataclass(frozen=True)
class CacheConfig(Settings):
    """The device tier (L1): pool sizes as SGLang's flags give them, and the tree."""

    page_size: int = setting(1, "tokens per KV page", check=count())
    max_total_tokens: int = setting(16384, "the KV budget: this many tokens in every KV layer (SGLang's meaning); "
                                           "with sliding-window layers it is split, and FULL holds what the "
                                           "window pool leaves (the start-up line says the split)", check=count())
    swa_full_tokens_ratio: float | None = setting(
        None, "SWA KV pool size as a fraction of the FULL pool, within the budget (SGLang's meaning; 1: every "
              "layer holds --max-total-tokens); default: derived from the workload, the windows of "
              "--max-running-requests requests, a prefill chunk and one prompt of the context length, and the "
              "rest to FULL", check=optional(number(above=0)))
    max_mamba_cache_size: int | None = setting(
        None, "recurrent state slots for running requests and checkpoints "
              "(default: 4 x --max-running-requests + 64)", check=optional(count()))
    swa_retention: str = setting(
        "spare", "what the tree keeps of sliding-window KV: 'windows', only the windows where requests "
                 "resumed or ended (the least memory); 'spare', every page a prompt computed, those no "
                 "resume point needs as spares that eviction takes first, so a request branching anywhere "
                 "off a cached prompt still finds its window while there is room", choices=SWA_RETENTIONS)
    radix_eviction_policy: str = setting("lru", "eviction order", choices=EVICTION_POLICIES)
    disable_radix_cache: bool = setting(False, "reuse nothing (the baseline)", check=flag_bool)

    def check(self) -> None:
        if self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens ({self.max_total_tokens}) is below one page "
                             f"(--page-size {self.page_size})")


@dataclass(frozen=True)
class HostTierConfig(Settings):
    """The host tier (L2): host mirrors of every device pool, and when data goes down."""

    enable_hierarchical_cache: bool = setting(
        False, "add the host tier (L2): host copies of every pool, loaded back layer by layer",
        check=flag_bool)
    hicache_ratio: float = setting(2.0, "host pools as a multiple of the device pools (must be > 1)",
                                   needs=("host",))
    hicache_size: float | None = setting(None, "host pools in GB in all; overrides --hicache-ratio",
                                         check=optional(number(above=0)), needs=("host",))
    hicache_write_policy: str = setting(
        "write_through", "when data goes down a tier: when cached (write_through), once reused "
        "--write-through-threshold times (write_through_selective), or when it leaves the tier above "
        "(write_back, needs --enable-hierarchical-cache)", choices=WRITE_POLICIES, needs=("host", "store"))
    write_through_threshold: int = setting(2, "accesses before write_through_selective writes a prefix",
                                           check=count(), needs=("selective",))

    def check(self) -> None:
        if self.enable_hierarchical_cache and self.hicache_size is None and number(above=1)(self.hicache_ratio):
            raise ValueError(f"--hicache-ratio must be a finite number > 1 (the host tier must be larger "
                             f"than the device tier), got {self.hicache_ratio!r}")

    @property
    def write_min_hits(self) -> int:
        """Accesses a node needs before it is written down (0: any)."""
        return self.write_through_threshold if self.hicache_write_policy == "write_through_selective" else 0


#: the longest announce_interval: a record read from a shared namespace that claims a
#: longer one is invalid (hicache/instances.py), so that no record, however written,
#: holds an announcement slot for more than 6 of these after it stops
ANNOUNCE_INTERVAL_MAX = 60.0

#: the environment variable that holds the L3 objects' MAC key when auth_secret is not set
L3_SECRET_ENV = "UNIRADIX_L3_SECRET"


@dataclass(frozen=True)
class StorageConfig(Settings):
    """Shared storage (L3): the backend, how long a request waits for a read, and what
    names the data (the model's fingerprint, the objects' MAC secret). The tier's own
    keys in the extra-config JSON are read into their fields here, whoever makes the
    config (the CLI, `Engine(**settings)`), so that each is in force or refused."""

    hicache_storage_backend: str | None = setting(
        None, "L3 shared storage: finished work is written through, deeper prefixes are loaded; a store "
              "that cannot be reached at start-up stops the start (see allow_unavailable_at_start)",
        choices=(None, *STORAGE_BACKENDS))
    hicache_storage_backend_extra_config: str | None = setting(
        None, "backend settings as a JSON object or @file (path, url, prefix, ...), and the tier's own: "
              "prefetch_threshold (tokens beyond the device hit worth a load, default 256), "
              "prefetch_timeout_base / _per_ki_token / _max (seconds, default 1 / 0.25 / 3), "
              "io_timeout (seconds, default 30: the longest wait for one read or a flush), "
              "model_fingerprint (the model's name in the store), auth_secret (MAC key of the objects), "
              "announce_interval (seconds between a server's announcements in its namespace, default 5), "
              "allow_unavailable_at_start (true: start even if the store cannot be reached yet, "
              "default false)",
        check=optional(text), needs=("store",))
    hicache_storage_prefetch_policy: str = setting("best_effort", "how long a request waits for its L3 read",
                                                   choices=PREFETCH_POLICIES, needs=("store",))
    prefetch_threshold: int = setting(256, "tokens beyond the device hit worth an L3 read", check=count(0),
                                      extra=True, needs=("store",))
    prefetch_timeout_base: float = setting(1.0, "seconds a timeout-policy read may take, base",
                                           check=number(at_least=0), extra=True, needs=("store",))
    prefetch_timeout_per_ki_token: float = setting(0.25, "seconds more per 1024 tokens read",
                                                   check=number(at_least=0), extra=True, needs=("store",))
    prefetch_timeout_max: float = setting(3.0, "seconds a timeout-policy read may take at most",
                                          check=number(at_least=0), extra=True, needs=("store",))
    io_timeout: float = setting(30.0, "seconds the tier waits for one L3 read (wait_complete too) or for the "
                                      "pending writes of a flush; past it the call is abandoned and counted",
                                check=number(above=0), extra=True, needs=("store",))
    model_fingerprint: str | None = setting(None, "the model's name in the store (default: a digest "
                                                  "of its config and weights)", check=optional(text),
                                            extra=True, needs=("store",))
    auth_secret: str | None = setting(None, "key of the objects' MAC (default: $UNIRADIX_L3_SECRET)",
                                      check=optional(text), extra=True, secret=True, needs=("store",))
    announce_interval: float = setting(5.0, "seconds between two announcements of a server in its L3 namespace "
                                            "(other instances count it gone after 6 missed; at most "
                                            f"{ANNOUNCE_INTERVAL_MAX:g})",
                                       check=number(above=0, at_most=ANNOUNCE_INTERVAL_MAX), extra=True,
                                       needs=("store",))
    allow_unavailable_at_start: bool = setting(
        False, "start even when the store cannot be reached at start-up (it may come later: L3 calls fail, "
               "counted, until it answers); by default an unreachable store stops the start",
        check=flag_bool, extra=True, needs=("store",))
    rank: int = setting(0, "tensor-parallel rank (part of the namespace)", check=count(0), flag=False,
                        needs=("store",))

    def __post_init__(self) -> None:
        self._read_tier_keys()
        super().__post_init__()

    def _read_tier_keys(self) -> None:
        """The tier's own keys of the extra-config JSON into their fields (a key also
        given as a setting, with another value, is refused: which would win?); an
        unknown prefetch_* key is refused too (a misspelt tier key would reach the
        backend, which names it less clearly)."""
        if not self.hicache_storage_backend_extra_config:
            return
        from_json = parse_extra_config(self.hicache_storage_backend_extra_config)
        keys = self.tier_keys()
        unknown = sorted(k for k in from_json if k.startswith("prefetch_") and k not in keys)
        if unknown:
            raise ValueError(f"--hicache-storage-backend-extra-config: unknown prefetch setting(s) {unknown}; "
                             f"known: {', '.join(k for k in keys if k.startswith('prefetch_'))}")
        declared = {f.name: f for f in fields(self)}
        for k in keys:
            if k not in from_json:
                continue
            v, mine = from_json[k], getattr(self, k)
            if mine != declared[k].default and mine != v:
                shown = HIDDEN if declared[k].metadata.get("secret") else f"{mine!r} and {v!r}"
                raise ValueError(f"{k} is given twice, as a setting and in --hicache-storage-backend-extra-config "
                                 f"({shown}): give it once")
            object.__setattr__(self, k, v)

    def as_dict(self) -> dict:
        """As Settings.as_dict; a secret taken from $UNIRADIX_L3_SECRET is in force too,
        and shown as such (hidden): `null` would tell an operator the objects are unkeyed."""
        out = super().as_dict()
        if self.hicache_storage_backend and self.auth_secret is None and os.environ.get(L3_SECRET_ENV):
            out["auth_secret"] = f"{HIDDEN} (from ${L3_SECRET_ENV})"
        return out

    @classmethod
    def tier_keys(cls) -> tuple[str, ...]:
        """The extra-config keys the tier reads itself; the rest go to the backend."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("extra"))

    def prefetch_timeout(self, tokens: int) -> float:
        """How long a request reading `tokens` waits under the timeout policy."""
        return min(self.prefetch_timeout_max,
                   self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens / 1024)

    def backend_settings(self) -> dict:
        """The extra config without the tier's keys: what configures the backend."""
        from_json = parse_extra_config(self.hicache_storage_backend_extra_config)
        return {k: v for k, v in from_json.items() if k not in self.tier_keys()}


@dataclass(frozen=True)
class SchedulerConfig(Settings):
    """Batching, where the model runs, and how long a request may be."""

    chunked_prefill_size: int = setting(256, "prefill tokens per step (and, with speculative decoding, the most "
                                             "draft tokens a step verifies)", check=count())
    max_running_requests: int = setting(16, "requests in a batch", check=count())
    device: str = setting("cpu", "cpu or cuda[:N]", check=text)
    context_length: int | None = setting(
        None, "the most tokens a request may span, prompt plus new tokens (default: the model's own, "
              "max_position_embeddings or a GGUF's context_length; the embedded model has none); longer "
              "requests are refused", check=optional(count(2)))
    allow_longer_context: bool = setting(
        False, "let --context-length exceed the model's own context (positions it was not trained on)",
        check=flag_bool)


#: how drafts are made: NGRAM, prompt lookup over the request's own tokens (SGLang's name);
#: SUFFIX, the continuation of its last tokens anywhere in its tenant's cached tree; both
SPECULATIVE_ALGORITHMS = ("NGRAM", "SUFFIX", "NGRAM+SUFFIX")
#: vLLM's --speculative-config methods, and the algorithm each is here (vLLM's suffix
#: decoding reads the request's own tokens and a global tree: both)
SPECULATIVE_METHODS = {"ngram": "NGRAM", "suffix": "NGRAM+SUFFIX"}
#: vLLM's --speculative-config keys, and the setting each is here
SPECULATIVE_CONFIG_KEYS = {"num_speculative_tokens": "speculative_num_draft_tokens",
                           "prompt_lookup_min": "speculative_ngram_min_match_window_size",
                           "prompt_lookup_max": "speculative_ngram_max_match_window_size"}


@dataclass(frozen=True)
class SpeculativeConfig(Settings):
    """Speculative decoding: a decoding request's drafts verified with it in one step,
    the replies unchanged (greedy: the same tokens; sampling: the same distribution)."""

    speculative_algorithm: str | None = setting(
        None, "how drafts are made: NGRAM, the continuation of the request's last tokens where they occurred "
              "before in its own prompt and output (prompt lookup); SUFFIX, their continuation anywhere in what "
              "the cache holds for the request's tenant (the most used one); NGRAM+SUFFIX, the first where it "
              "matches at least 4 tokens, else the second; default off",
        choices=(None, *SPECULATIVE_ALGORITHMS))
    speculative_num_draft_tokens: int = setting(
        16, "draft tokens a request verifies in one step, at most (fewer while its drafts are being rejected: "
            "it drafts while the chance that the next draft is kept pays for its row; fewer where the pools "
            "lack free room for them; no more than the reply has left, nor than its even share of the step's "
            "--chunked-prefill-size)", check=count(), needs=("spec",))
    speculative_ngram_min_match_window_size: int = setting(
        1, "the fewest of a request's last tokens that must have occurred before for a draft", check=count(),
        needs=("spec",))
    speculative_ngram_max_match_window_size: int = setting(
        12, "the most of its last tokens a match is extended to (the longest match among the earlier "
            "occurrences is drafted from)", check=count(), needs=("spec",))
    speculative_config: str | None = setting(
        None, "vLLM's form, a JSON object: method (ngram, or suffix: NGRAM+SUFFIX), num_speculative_tokens, "
              "prompt_lookup_min, prompt_lookup_max; read into the settings above", check=optional(text))

    def __post_init__(self) -> None:
        self._read_vllm_form()
        super().__post_init__()

    def _read_vllm_form(self) -> None:
        """--speculative-config into the fields (a key also given as a flag with another
        value is refused: which would win?)."""
        if not self.speculative_config:
            return
        try:
            cfg = json.loads(self.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {type(cfg).__name__}")
        unknown = sorted(set(cfg) - {"method", *SPECULATIVE_CONFIG_KEYS})
        if unknown:
            raise ValueError(f"--speculative-config: unsupported key(s) {unknown}; supported: method, "
                             f"{', '.join(SPECULATIVE_CONFIG_KEYS)}")
        method = cfg.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {method!r}")
        declared = {f.name: f for f in fields(self)}
        values = {"speculative_algorithm": SPECULATIVE_METHODS[method]}
        values.update({SPECULATIVE_CONFIG_KEYS[k]: v for k, v in cfg.items() if k in SPECULATIVE_CONFIG_KEYS})
        for name, v in values.items():
            mine = getattr(self, name)
            if mine != declared[name].default and mine != v:
                raise ValueError(f"{flag_name(name)} {mine!r} and --speculative-config's {v!r} disagree: give one")
            object.__setattr__(self, name, v)

    def check(self) -> None:
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if lo > hi:
            raise ValueError(f"--speculative-ngram-min-match-window-size ({lo}) is above "
                             f"--speculative-ngram-max-match-window-size ({hi})")

    @property
    def on(self) -> bool:
        return self.speculative_algorithm is not None


#: the dtypes a checkpoint is served in
DTYPES = ("float32", "bfloat16", "float16")
#: the weight-only quantizations of its linear weights (uniradix.model.hf.quant)
QUANTIZATIONS = ("none", "int8", "int4", "stored")


@dataclass(frozen=True)
class ModelSettings(Settings):
    """Which model `uniradix run` serves (an Engine takes the model itself)."""

    model_preset: str = setting("tiny-hybrid", "layer layout of the embedded reference model (tiny-hybrid: F+S+M)",
                                check=text)
    model_path: str | None = setting(None, "a Hugging Face checkpoint directory or a .gguf file to serve, or a "
                                           "safetensors file of weights for the preset (default: the preset, "
                                           "seeded)", check=optional(text))
    dtype: str = setting("float32", "weights, activations and KV dtype of a checkpoint (bfloat16: half the "
                                    "memory and about twice as fast on a CPU with AVX512-BF16 or a GPU; "
                                    "recurrent states, norms, attention and routing stay float32)",
                         choices=DTYPES)
    quantization: str = setting("none", "weight-only quantization of a checkpoint's linear weights (the head "
                                        "included): int8 per output channel, or int4 in groups of 32, "
                                        "multiplied by torch's own CPU kernels in bfloat16; stored: each as a "
                                        ".gguf stores it (types under 5 bits per weight as int4, up to 8 as "
                                        "int8, float ones dense)", choices=QUANTIZATIONS)


@dataclass(frozen=True)
class ComputeSettings(Settings):
    """How the `uniradix run` / `serve` process computes, applied at its start (an
    Engine made in a program leaves the caller's torch settings alone)."""

    num_threads: int | None = setting(
        None, "CPU threads torch computes with (torch.set_num_threads; default: $OMP_NUM_THREADS when set, "
              "else 1: on a machine that runs anything else, more threads wait on each other and are slower)",
        check=optional(count()))


GROUPS = {"cache": CacheConfig, "host": HostTierConfig, "storage": StorageConfig,
          "scheduler": SchedulerConfig, "speculative": SpeculativeConfig}


@dataclass(frozen=True)
class EngineConfig:
    """All of an engine's settings, by concern."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    host: HostTierConfig = field(default_factory=HostTierConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.host.hicache_write_policy == "write_back" and not self.host.enable_hierarchical_cache:
            raise ValueError("--hicache-write-policy write_back writes on eviction from the host tier: "
                             "it needs --enable-hierarchical-cache")

    @classmethod
    def of(cls, **settings) -> "EngineConfig":
        """From settings by name, each going to its concern (unknown names refused)."""
        parts = {group: {} for group in GROUPS}
        owner = {f.name: group for group, c in GROUPS.items() for f in fields(c)}
        for name, v in settings.items():
            if name not in owner:
                raise TypeError(f"unknown setting {name!r}; see uniradix.config for the settings")
            parts[owner[name]][name] = v
        return cls(**{group: GROUPS[group](**kw) for group, kw in parts.items()})

    def with_(self, **settings) -> "EngineConfig":
        """A copy with some settings changed (checked again)."""
        flat = {k: v for group in GROUPS for k, v in _plain(getattr(self, group)).items()}
        return EngineConfig.of(**{**flat, **settings})

    def as_dict(self) -> dict:
        """Every setting by name (secrets hidden): what a server reports as in force."""
        return {k: v for group in GROUPS for k, v in getattr(self, group).as_dict().items()}

    def not_in_effect(self, *, store: bool) -> list[tuple[str, tuple[str, ...]]]:
        """The settings given (away from their defaults: a default changes nothing
        either way) that the engine would not use, each with what it needs (NEEDS
        names): a tier or a policy that is off. `store`: the engine has an L3 store."""
        have = {"store": store, "host": self.host.enable_hierarchical_cache,
                "selective": self.host.hicache_write_policy == "write_through_selective",
                "spec": self.speculative.on}
        out = []
        for group in GROUPS:
            cfg = getattr(self, group)
            for f in fields(cfg):
                needs = f.metadata.get("needs") or ()
                if needs and not any(have[n] for n in needs) and getattr(cfg, f.name) != f.default:
                    out.append((f.name, needs))
        return out

    @classmethod
    def only_in_effect(cls, settings: dict, *, store: bool) -> dict:
        """`settings` without those that would not take effect: for a program that
        replays one configuration's settings under another (a tier turned off)."""
        settings = dict(settings)
        while idle := cls.of(**settings).not_in_effect(store=store):
            for name, _ in idle:   # each is in `settings`: nothing else is away from its default
                del settings[name]
        return settings

    def check_in_effect(self, *, store: bool) -> None:
        """Refuse a setting given that would not take effect (see not_in_effect): a
        ValueError naming the first and what it needs, never a setting silently ignored."""
        idle = self.not_in_effect(store=store)
        if idle:
            name, needs = idle[0]
            f = next(f for group in GROUPS for f in fields(getattr(self, group)) if f.name == name)
            more = f" (and {', '.join(n for n, _ in idle[1:])})" if len(idle) > 1 else ""
            raise ValueError(f"{_label(f)}{more} has no effect without {' or '.join(NEEDS[n] for n in needs)}: "
                             f"add that, or leave it out")


def _plain(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}


# ---------------------------------------------------------------------------- the CLI
def _parse(kind, inner):
    def parse(text_value: str):
        try:
            return inner(text_value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text_value!r} is not {kind}") from None
    return parse


def _arg_type(f):
    d = f.default
    hint = str(f.type)
    if "int" in hint and "float" not in hint:
        return _parse("an int", int)
    if "float" in hint:
        return _parse("a number", float)
    return str if d is None or isinstance(d, str) else type(d)


def add_flags(parser, config_cls, title: str | None = None, choices: dict | None = None) -> None:
    """One flag per setting of `config_cls` (not the extra-config ones); `choices`:
    allowed values known only above this module (the model presets, say)."""
    g = parser.add_argument_group(title or config_cls.__doc__.split("\n")[0])
    for f in fields(config_cls):
        md = f.metadata
        if not md.get("flag"):
            continue
        kw = dict(default=f.default if f.default is not MISSING else None, help=md["help"], dest=f.name)
        if isinstance(f.default, bool):
            g.add_argument(flag_name(f.name), action="store_true", **kw)
            continue
        allowed = (choices or {}).get(f.name, md.get("choices"))
        if allowed is not None:
            kw["choices"] = [c for c in allowed if c is not None]
        else:
            kw["type"] = _arg_type(f)
        if md.get("metavar"):
            kw["metavar"] = md["metavar"]
        if md.get("several"):
            kw["nargs"] = "+"
        g.add_argument(flag_name(f.name), **kw)


def from_args(config_cls, ns: argparse.Namespace, **extra):
    """A config from parsed flags (and `extra` fields not offered as flags)."""
    kw = {f.name: getattr(ns, f.name) for f in fields(config_cls) if f.metadata.get("flag") and hasattr(ns, f.name)}
    for f in fields(config_cls):
        if f.metadata.get("several") and isinstance(kw.get(f.name), list):
            kw[f.name] = tuple(kw[f.name])
    return config_cls(**kw, **extra)


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """The engine's settings from `uniradix run` / `serve` flags (the storage tier's own
    come out of the extra config JSON: StorageConfig reads them)."""
    return EngineConfig(cache=from_args(CacheConfig, ns), host=from_args(HostTierConfig, ns),
                        storage=from_args(StorageConfig, ns), scheduler=from_args(SchedulerConfig, ns),
                        speculative=from_args(SpeculativeConfig, ns))


_DECLARED: set = set()


def declare_plain_settings(cls) -> None:
    """The settings of `cls` that are not secrets are shown under their names wherever
    text is masked (uniradix.redact.declare_plain), once per class."""
    if cls not in _DECLARED:
        _DECLARED.add(cls)
        declare_plain(f.name for f in fields(cls) if "help" in f.metadata and not f.metadata.get("secret"))


for _cls in (CacheConfig, HostTierConfig, StorageConfig, SchedulerConfig, SpeculativeConfig, ModelSettings,
             ComputeSettings):
    declare_plain_settings(_cls)


def redact_extra_config(text_value: str) -> str:
    """The extra config as JSON with the values of keys that name a secret hidden and
    the secrets inside its texts (URL passwords, secret query keys) masked, by
    uniradix.redact's one rule; the tier's own keys are shown by what StorageConfig
    declares of them (auth_secret hidden, prefetch_timeout_per_ki_token shown);
    unparseable text is hidden whole (an @file is shown as given)."""
    if text_value.startswith("@"):
        return text_value
    try:
        cfg = json.loads(text_value)
    except ValueError:
        return HIDDEN
    if not isinstance(cfg, dict):
        return HIDDEN
    declared = {f.name: bool(f.metadata.get("secret")) for f in fields(StorageConfig) if f.metadata.get("extra")}
    return json.dumps({k: (HIDDEN if declared[k] and v not in (None, "") else redact_value("", v)) if k in declared
                       else redact_value(k, v) for k, v in cfg.items()})


def parse_extra_config(text_value: str | dict | None) -> dict:
    """`--hicache-storage-backend-extra-config`: a JSON object, or @path to a file
    holding one."""
    if text_value is None or text_value == "":
        return {}
    if isinstance(text_value, dict):
        return dict(text_value)
    if not isinstance(text_value, str):
        raise ValueError(f"the storage extra config must be JSON text or a dict, got {type(text_value).__name__}")
    src = "--hicache-storage-backend-extra-config"
    if text_value.startswith("@"):
        src = text_value[1:]
        try:
            with open(src) as fh:
                text_value = fh.read()
        except OSError as e:
            raise ValueError(f"cannot read the storage extra config file {src}: {e}") from e
    try:
        cfg = json.loads(text_value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{src} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{src} must be a JSON object, got {type(cfg).__name__}")
    return cfg


__all__ = ["CacheConfig", "EngineConfig", "HostTierConfig", "ModelSettings", "SchedulerConfig", "SpeculativeConfig",
           "StorageConfig",
           "ComputeSettings", "Settings",
           "setting", "add_flags", "from_args", "engine_config_from_args", "parse_extra_config",
           "EVICTION_POLICIES", "WRITE_POLICIES", "PREFETCH_POLICIES", "STORAGE_BACKENDS", "replace"]
