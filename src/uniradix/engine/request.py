"""What a client asks for and what it gets back: the request, its sampling
parameters, and the per-request metrics."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

_ids = itertools.count()


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. `seed` makes sampling repeatable per request; `stop_ids`
    end the request when generated (the stop token is kept in the output)."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))


@dataclass
class RequestMetrics:
    """prompt_tokens: the prompt's length. cached_tokens: prompt tokens reused from the
    cache at admission, `host_tokens` of them loaded from the host tier (L2) and
    `storage_tokens` from L3. computed_tokens: tokens run through prefill (more than
    prompt - cached only when the request was preempted and resumed). Times are seconds
    from `time.perf_counter`."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_tokens: int = 0
    storage_tokens: int = 0
    computed_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
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
    After the run: `status` is "finished" or "error"; `output_ids`, `finish_reason`
    ("length", "stop" or "error"), `error` and `metrics` say what happened. With
    `record_logits`, `logits` holds the logits each output token was drawn from."""

    input_ids: list[int] | None = None
    text: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: object = None
    salt: object = None
    priority: int | None = None
    record_logits: bool = False
    rid: int = field(default_factory=lambda: next(_ids))
    status: str = "new"
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    logits: list = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    def __post_init__(self) -> None:
        self.metrics.arrival = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.status in ("finished", "error")
