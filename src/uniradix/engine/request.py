"""What a client asks for and what it gets back: the request, its sampling
parameters, and the per-request metrics."""
from __future__ import annotations

import itertools
import numbers
import time
from array import array
from dataclasses import dataclass, field
from functools import cached_property

from ..config import finite_number
from ..tree.keys import check_priority, check_session_id, salt_key

_ids = itertools.count()


#: temperatures below this are greedy (as SGLang treats them): dividing logits by a
#: subnormal temperature overflows, and the draw would be an argmax anyway
GREEDY_BELOW = 1e-5
#: new tokens when a request names no count
DEFAULT_MAX_NEW_TOKENS = 16
#: the most alternatives a request may ask logprobs for, per token (vLLM's limit)
MAX_TOP_LOGPROBS = 20


def _is_int(v) -> bool:
    """An integer that is not a bool (numpy integers count: they are Integral)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_token_ids(name: str, ids, vocab_size: int | None = None) -> list[int]:
    """A list of token ids from a sequence of ints in [0, vocab_size): not a str or bytes
    (whose items would pass for ids), and no floats, bools or strings inside."""
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, (list, tuple, range, array)) \
            and not hasattr(ids, "__array__"):
        raise ValueError(f"{name} must be a list of token ids (ints), got {type(ids).__name__}")
    out = ids if type(ids) is list and all(type(t) is int for t in ids) else None
    if out is None:
        out = []
        for t in ids:
            if not _is_int(t):
                raise ValueError(f"{name} must hold ints, got {type(t).__name__} {t!r:.20}")
            out.append(int(t))
    if out:
        lo, hi = min(out), max(out)
        if lo < 0 or (vocab_size is not None and hi >= vocab_size):
            bad = [t for t in out if t < 0 or (vocab_size is not None and t >= vocab_size)][:5]
            raise ValueError(f"{name}: token ids must be in [0, {vocab_size or 'vocab'}), got {bad}")
    return list(out)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy (and so is any temperature below 1e-5); `top_k` keeps the
    k likeliest tokens (-1: all), `top_p` the smallest set reaching that mass. `seed`
    makes sampling repeatable per request; `stop_ids` end the request when generated
    (the stop token is kept in the output), `stop` strings when the output's text comes
    to contain one (the engine's tokenizer decodes it). Every field is checked here,
    types included, so a bad value is a ValueError naming it, never a failure inside a
    later step.

    `max_new_tokens` left out (None) is 16, and `fit_context` then defaults to True:
    a default the caller did not choose is shortened to the room the model's context
    leaves after the prompt, where a count the caller gave is refused if it does not fit
    (as vLLM does). The server sets `fit_context` for its own defaults (an OpenAI request
    without `max_tokens`, say)."""

    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    fit_context: bool | None = None

    def __post_init__(self) -> None:
        if self.fit_context is None:
            object.__setattr__(self, "fit_context", self.max_new_tokens is None)
        if not isinstance(self.fit_context, bool):
            raise ValueError(f"fit_context must be a bool, got {self.fit_context!r}")
        if self.max_new_tokens is None:
            object.__setattr__(self, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        t = self.temperature
        if not finite_number(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r:.40}")
        p = self.top_p
        if not finite_number(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r:.40}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (all tokens) or an int >= 1, got {self.top_k!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r:.60}")
        object.__setattr__(self, "stop", tuple(stop))
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "temperature", 0.0 if t < GREEDY_BELOW else float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "stop_ids", tuple(check_token_ids("stop_ids", self.stop_ids)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @cached_property
    def stop_set(self) -> frozenset:
        """stop_ids for the per-token membership test."""
        return frozenset(self.stop_ids)

    @cached_property
    def stop_tail(self) -> int:
        """Output tokens whose text holds any stop string that ends in the newest one:
        every token is at least one byte (byte-level and byte-fallback vocabularies), so
        a string's UTF-8 length, and a few more for special tokens that decode to nothing."""
        return max((len(s.encode("utf-8")) for s in self.stop), default=0) + 4


@dataclass
class RequestMetrics:
    """prompt_tokens: the prompt's length. cached_tokens: prompt tokens reused from the
    cache at admission, `host_tokens` of them loaded from the host tier (L2) and
    `storage_tokens` from L3, `cross_instance_tokens` of those from L3 objects another
    instance wrote (a fleet's shared reuse). computed_tokens: tokens run through prefill (more than
    prompt - cached only when the request was preempted and resumed). Speculation
    (SGLang's names): `spec_verify_ct` verify steps, `spec_draft_tokens` drafts verified,
    `spec_accepted_tokens` of them kept. Times are seconds from `time.perf_counter`."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_tokens: int = 0
    storage_tokens: int = 0
    cross_instance_tokens: int = 0
    computed_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    arrival: float = 0.0
    first_token: float | None = None
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass(eq=False)
class Request:
    """A generation request. Give `input_ids`, or `text` for the engine's tokenizer.
    After the run: `status` is "finished", "error" or "aborted"; `output_ids`,
    `finish_reason` ("length", "stop", "error" or "abort"), `matched_stop` (the stop id or
    string that ended it), `error` and `metrics` say what happened. With
    `record_logits`, `logits` holds the logits each output token was drawn from. With
    `logprobs` k (0 to MAX_TOP_LOGPROBS), `output_logprobs` holds, per output token, its
    log probability under the model's distribution at that step (the raw logits'
    log-softmax, before temperature, top-k and top-p, as vLLM reports by default) and
    the k likeliest tokens with theirs: (logprob, [(token id, logprob), ...]). With
    `prompt_logprobs_from` p, `prompt_logprobs` holds the same for each prompt token from
    position p on (None for position 0, which nothing predicts); the engine reuses the
    cache only up to p - 1 for it and computes the rest, so they come from this step's
    logits, as the cache-off engine's do."""

    input_ids: list[int] | None = None
    text: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: object = None
    salt: object = None
    priority: int | None = None
    record_logits: bool = False
    logprobs: int | None = None
    prompt_logprobs_from: int | None = None
    rid: int = field(default_factory=lambda: next(_ids))
    status: str = "new"
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    logits: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    def __post_init__(self) -> None:
        self.metrics.arrival = time.perf_counter()

    def check(self, vocab_size: int) -> list[int]:
        """Every field a step will use, checked before the request is queued (a value that
        passed here cannot fail a later step): returns the prompt's ids. ValueError names
        the field."""
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give a request exactly one of input_ids or text")
        if self.text is not None and not isinstance(self.text, str):
            raise ValueError(f"text must be a str, got {type(self.text).__name__}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        check_priority(self.priority)
        check_session_id(self.session_id)
        salt_key(self.salt)  # the one salt rule: None, str, bytes or int
        if not isinstance(self.record_logits, bool):
            raise ValueError(f"record_logits must be a bool, got {self.record_logits!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be an int in [0, {MAX_TOP_LOGPROBS}] (the top tokens returned beside "
                             f"the sampled one), got {self.logprobs!r:.20}")
        p = self.prompt_logprobs_from
        if p is not None and not (_is_int(p) and p >= 0):
            raise ValueError(f"prompt_logprobs_from must be an int >= 0 (a prompt position), got {p!r:.20}")
        bad = [t for t in self.sampling.stop_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_ids must be in [0, {vocab_size}), got {bad[:5]}")
        if self.input_ids is None:
            return []
        return check_token_ids("input_ids", self.input_ids, vocab_size)

    @property
    def done(self) -> bool:
        return self.status in ("finished", "error", "aborted")
