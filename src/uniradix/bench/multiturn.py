"""The multi-turn workload: several clients, each extending one conversation over
rounds. Each round every client sends its whole conversation so far plus new tokens;
the round's hit rate is cached prefix tokens over prompt tokens, summed over the round."""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

from ..config import Settings, count, optional, setting


@dataclass(frozen=True)
class MultiTurnWorkload(Settings):
    """`shared_prefix_tokens` open every conversation (a system prompt all clients
    share); the first round adds `first_round_tokens` of the client's own (a document
    pasted in; default `tokens_per_round`), each later round `tokens_per_round` new user
    tokens; every round asks for `output_tokens` (greedy)."""

    clients: int = setting(8, "conversations in flight together", check=count())
    rounds: int = setting(8, "turns per conversation", check=count())
    tokens_per_round: int = setting(128, "new user tokens each turn", check=count())
    output_tokens: int = setting(16, "tokens generated each turn", check=count())
    shared_prefix_tokens: int = setting(128, "a system prompt every conversation opens with", check=count(0))
    vocab_size: int = setting(256, "token ids are drawn below this", check=count(), flag=False)
    seed: int = setting(0, "seed of the generated conversations", check=count(0))
    first_round_tokens: int | None = setting(
        None, "each client's own tokens in its first turn, e.g. a document (default: --tokens-per-round)",
        check=optional(count()))

    @property
    def requests(self) -> int:
        return self.clients * self.rounds

    @property
    def first_tokens(self) -> int:
        return self.tokens_per_round if self.first_round_tokens is None else self.first_round_tokens

    @property
    def final_context(self) -> int:
        """Tokens one conversation holds after the last round (its share of the working set)."""
        return (self.shared_prefix_tokens + self.first_tokens + (self.rounds - 1) * self.tokens_per_round
                + self.rounds * self.output_tokens)


@dataclass
class RoundReport:
    """One round, summed over the requests it served (failed ones are counted in
    `errors`, with their reasons in `error_messages`, and nothing else). Throughput is
    served prompt tokens (cached ones included) per second of the round's wall time.
    With nothing served, hit rate, TTFT and throughput are None: there is no figure."""

    round: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    wall_s: float
    ttfts: list = field(default_factory=list)
    errors: int = 0
    error_messages: list = field(default_factory=list)

    @property
    def served(self) -> int:
        return self.requests - self.errors

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def ttft_mean(self) -> float | None:
        return statistics.fmean(self.ttfts) if self.ttfts else None

    @property
    def input_throughput(self) -> float | None:
        return self.prompt_tokens / self.wall_s if self.served and self.wall_s > 0 else None

    def as_dict(self) -> dict:
        return dict(round=self.round, requests=self.requests, prompt_tokens=self.prompt_tokens,
                    cached_tokens=self.cached_tokens, computed_tokens=self.computed_tokens,
                    hit_rate=self.hit_rate, ttft_mean_s=self.ttft_mean, wall_s=self.wall_s,
                    input_throughput=self.input_throughput, errors=self.errors,
                    error_messages=list(self.error_messages))


def run_multiturn(engine, workload: MultiTurnWorkload, progress=None, chat=None,
                  transcript: list | None = None) -> list[RoundReport]:
    """Drive `engine` (anything with `run(requests, progress)` taking Requests) through
    the workload; each client's next prompt is its last prompt + the output + new tokens.
    With `chat` (a tokenizer with apply_chat_template and decode, a real checkpoint's),
    the conversations are text: each turn adds a user message of about
    `tokens_per_round` tokens of words, the prompt is the chat template over the whole
    conversation, and the reply is decoded into the next turn's history (text in, text
    out). Returns one report per round; with `chat`, `transcript` (a list) receives the
    first client's conversation."""
    from ..engine import Request, SamplingParams

    rng = random.Random(workload.seed)
    if chat is not None:
        return _run_chat(engine, workload, progress, chat, rng, transcript)
    V = workload.vocab_size

    def fresh(n):
        return [rng.randrange(V) for _ in range(n)]

    shared = fresh(workload.shared_prefix_tokens)
    convs = [shared + fresh(workload.first_tokens) for _ in range(workload.clients)]
    sampling = SamplingParams(max_new_tokens=workload.output_tokens)
    reports = []
    for rnd in range(workload.rounds):
        reqs = [Request(input_ids=list(c), sampling=sampling, session_id=f"client-{i}")
                for i, c in enumerate(convs)]
        reports.append(_round(engine, rnd, reqs, progress))
        convs = [r.input_ids + r.output_ids + fresh(workload.tokens_per_round) for r in reqs]
    for i in range(workload.clients):
        engine.close_session(f"client-{i}")
    return reports


def _round(engine, rnd: int, reqs: list, progress) -> RoundReport:
    t0 = time.perf_counter()
    engine.run(reqs, progress)
    wall = time.perf_counter() - t0
    ok = [r for r in reqs if r.status == "finished"]
    why = list(dict.fromkeys(r.error or r.status for r in reqs if r.status != "finished"))
    return RoundReport(rnd + 1, len(reqs), sum(r.metrics.prompt_tokens for r in ok),
                       sum(r.metrics.cached_tokens for r in ok), sum(r.metrics.computed_tokens for r in ok),
                       wall, [r.metrics.ttft for r in ok], len(reqs) - len(ok), why)


WORDS = ("the cache keeps what a later request can resume from, page by page, and the tree decides "
         "which slots stay on the device, which go down to the host, and which are written to shared "
         "storage so another engine can read them back; every layer kind asks its own question of a "
         "reuse point, and the answer is the deepest boundary that all of them accept").split()


def _run_chat(engine, workload, progress, tok, rng, transcript) -> list[RoundReport]:
    from ..engine import Request, SamplingParams

    def words(n_tokens: int) -> str:
        out, n = [], 0
        while n < n_tokens:
            w = rng.choice(WORDS)
            out.append(w)
            n += len(tok.encode(" " + w, add_special_tokens=False))
        return " ".join(out)

    system = words(workload.shared_prefix_tokens) if workload.shared_prefix_tokens else None
    convs = []
    for _ in range(workload.clients):
        msgs = [{"role": "system", "content": system}] if system else []
        convs.append(msgs + [{"role": "user", "content": words(workload.first_tokens)}])
    eos = tuple(getattr(engine.model, "eos_token_ids", ()) or ())
    sampling = SamplingParams(max_new_tokens=workload.output_tokens, stop_ids=eos)
    reports = []
    for rnd in range(workload.rounds):
        reqs = [Request(input_ids=tok.encode_chat(m), sampling=sampling, session_id=f"client-{i}")
                for i, m in enumerate(convs)]
        reports.append(_round(engine, rnd, reqs, progress))
        for m, r in zip(convs, reqs):
            m.append({"role": "assistant", "content": tok.decode(r.output_ids)})
            m.append({"role": "user", "content": words(workload.tokens_per_round)})
    for i in range(workload.clients):
        engine.close_session(f"client-{i}")
    if transcript is not None:
        transcript.extend(convs[0][:-1])
    return reports
