"""Request bodies in, engine Requests out: SGLang's `/generate` and OpenAI's completions
and chat completions. Each body is validated by its model (bodies.py, the one
declaration of what it may hold); anything wrong is a `BadRequest` naming the field (a
4xx), never an exception from deeper down.

`/generate` takes every field of SGLang's own request and sampling parameters
(compat.py sorts them: used, ignored, accepted at their neutral value only); a field
SGLang does not know either is ignored with one warning per name, as SGLang and vLLM
do. OpenAI clients send many optional fields, so the OpenAI routes ignore the ones
they do not use but refuse values they cannot honour (n > 1, prompt logprobs)."""
from __future__ import annotations

import json
import numbers
import re
from dataclasses import dataclass

from pydantic import ValidationError

from ..engine import Request, SamplingParams
from .bodies import (ChatRequest, CompletionRequest, GenerateRequest, OpenAIRequest, SGLangSampling, describe)


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass
class Job:
    """One prompt of an HTTP request: the engine's Request and how its text comes back."""

    req: Request
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | None = None
    logprobs: bool = False            # the answer carries the output tokens' logprobs (logprobs.py)
    echo: bool = False                # completions: the prompt's text (and logprobs) before the output's
    session: tuple | None = None      # SGLang's session continuation: (id, rid, offset, drop_previous_output)
    text_in_logprobs: bool = False    # ... with each token's text (SGLang's return_text_in_logprobs)


# ---------------------------------------------------------------------------- checks
def _int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def want(cond: bool, name: str, what: str, value) -> None:
    """A hand check, for the small bodies and query values no model declares."""
    if not cond:
        shown = repr(value)
        raise BadRequest(f"{name} must be {what}, got {shown[:60]}")


def validated(model, body):
    """`body` (decoded JSON) as `model`, or a 400 naming the field."""
    try:
        return model.__pydantic_validator__.validate_python(body)  # model_validate less its Python wrapper
    except ValidationError as e:
        raise BadRequest(describe(e)) from None


def parse_json(raw: bytes):
    """A request body: JSON (no NaN or Infinity), with no lone surrogate in any string
    (JSON escapes can write one; no tokenizer takes it and no response can encode it)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the request body nests too deeply") from None
    if re.search(rb"\\u[dD][89a-fA-F]", raw):  # escaped surrogates: look for an unpaired one
        stack = [(body, "the request body")]
        while stack:
            x, at = stack.pop()
            if isinstance(x, str):
                try:
                    x.encode("utf-8")
                except UnicodeEncodeError:
                    raise BadRequest(f"{at}: not valid Unicode (an unpaired surrogate)") from None
            elif isinstance(x, dict):
                stack.extend((k, at) for k in x)
                stack.extend((v, k if at == "the request body" else f"{at}.{k}") for k, v in x.items())
            elif isinstance(x, list):
                stack.extend((v, f"{at}[{i}]") for i, v in enumerate(x))
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


# ---------------------------------------------------------------------------- SGLang's /generate
#: new tokens when sampling_params names none (SGLang's default)
GENERATE_MAX_NEW_TOKENS = 128


def _salt(extra_key, cache_salt):
    """SGLang's two cache partitions, `extra_key` and `cache_salt` (an empty string is
    none, as SGLang reads it), as the tree's one salt: requests share cached prefixes
    only when both match (vLLM's `cache_salt` on the OpenAI routes is the second)."""
    extra_key, cache_salt = extra_key or None, cache_salt or None
    return None if extra_key is None and cache_salt is None else json.dumps([extra_key, cache_salt])


def session_route(body, need_id: bool) -> tuple:
    """(session id or None, salt) of an `/open_session` or `/close_session` body. A
    session belongs to a tenant, so these routes take the same `extra_key` and
    `cache_salt` fields as /generate (the OpenAI routes' `cache_salt` is the second)
    and act on that tenant's session of the id only."""
    want(isinstance(body, dict), "the request body", "a JSON object", body)
    sid = body.get("session_id")
    want((sid is None and not need_id) or (isinstance(sid, str) and sid) or _int(sid),
         "session_id", "a non-empty string or an int", sid)
    extra_key, cache_salt = body.get("extra_key"), body.get("cache_salt")
    want(extra_key is None or isinstance(extra_key, str), "extra_key", "a string", extra_key)
    want(cache_salt is None or isinstance(cache_salt, str), "cache_salt", "a string", cache_salt)
    return sid, _salt(extra_key, cache_salt)


def parse_generate(body, eos: tuple[int, ...], max_batch: int) -> tuple[list[Job], bool, bool]:
    """(jobs, batched, stream) for a `/generate` body."""
    g = validated(GenerateRequest, body)
    batched, prompts = g.batched, g.prompts
    if batched and not 1 <= len(prompts) <= max_batch:
        raise BadRequest(f"a batch holds 1 to {max_batch} prompts, got {len(prompts)}")
    n = len(prompts)
    # a batch's one rid prefixes its prompts' ids, as SGLang's does
    rids = [f"{g.rid}_{i}" for i in range(n)] if batched and isinstance(g.rid, str) else g.each("rid", n)
    sp = g.session_params
    continuation = None if sp is None else (sp.id, sp.rid, sp.offset, bool(sp.drop_previous_output))
    sid = sp.id if sp is not None else g.session_id
    salts = [_salt(e, c) for e, c in zip(g.each("extra_key", n), g.each("cache_salt", n))]
    jobs = []
    for i, (p, sp, rid, salt, want_lp, top, start) in enumerate(zip(
            prompts, g.each("sampling_params", n), rids, salts, g.each("return_logprob", n),
            g.each("top_logprobs_num", n), g.each("logprob_start_len", n))):
        sampling, extra = sampling_from_sglang(sp or DEFAULT_SAMPLING, eos,
                                               f"sampling_params[{i}]" if batched else "sampling_params")
        lp = (top or 0) if want_lp else None
        start = start if lp is not None and start is not None and start >= 0 else None
        req = Request(input_ids=None if g.text is not None else p, text=p if g.text is not None else None,
                      sampling=sampling, session_id=sid, priority=g.priority, salt=salt, logprobs=lp,
                      prompt_logprobs_from=start)
        jobs.append(Job(req, sampling.stop, rid=rid, logprobs=lp is not None,
                        text_in_logprobs=g.return_text_in_logprobs, session=continuation, **extra))
    return jobs, batched, g.stream


DEFAULT_SAMPLING = SGLangSampling()


def _stops(stop) -> tuple[str, ...]:
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


def _stop_ids(given, ignore_eos: bool, eos: tuple[int, ...]) -> list[int]:
    """The ids that end a request: the ones it gave, and the model's EOS unless ignored (a
    list: SamplingParams checks a list of ints at once)."""
    return [*(given or ()), *(() if ignore_eos else eos)]


def sampling_from_sglang(sp: SGLangSampling, eos: tuple[int, ...], prefix: str) -> tuple[SamplingParams, dict]:
    """SGLang's sampling_params (its defaults: 128 new tokens, temperature 1; the
    default count is shortened to the room the context leaves, a given one is not)."""
    sampling = make_sampling(sp, eos, sp.max_new_tokens, GENERATE_MAX_NEW_TOKENS, sp.the_seed, prefix + ".",
                             {"stop_ids": "stop_token_ids"})
    return sampling, dict(skip_special_tokens=sp.skip_special_tokens, no_stop_trim=sp.no_stop_trim)


def make_sampling(m, eos: tuple[int, ...], count, default: int, seed, prefix: str, names: dict) -> SamplingParams:
    """The engine's SamplingParams of a validated body `m` (SGLang's sampling_params or an
    OpenAI request): `count` new tokens, else `default` shortened to the context's room;
    the model's EOS ends it unless `ignore_eos`. A null value is the default."""
    try:
        return SamplingParams(max_new_tokens=default if count is None else count, fit_context=count is None,
                              temperature=1.0 if m.temperature is None else m.temperature,
                              top_p=1.0 if m.top_p is None else m.top_p, top_k=-1 if m.top_k is None else m.top_k,
                              seed=seed, stop=_stops(m.stop), stop_ids=_stop_ids(m.stop_token_ids, m.ignore_eos, eos))
    except ValueError as e:  # SamplingParams names the field (by the engine's name)
        msg = str(e)
        for engine_name, api_name in names.items():
            msg = msg.replace(engine_name, api_name)
        raise BadRequest(prefix + msg) from None


# ---------------------------------------------------------------------------- OpenAI
#: new tokens when a request names none: OpenAI's 16 for completions; a chat reply needs
#: more (OpenAI fills the context; 128 is SGLang's native default). Either default is
#: shortened to the room the context leaves after the prompt; a count the client gave
#: is refused (400) if it does not fit
COMPLETION_MAX_TOKENS = 16
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "stop_ids": "stop_token_ids"}
CHAT_NAMES = {**OPENAI_NAMES, "max_new_tokens": "max_completion_tokens"}  # when that is the count given
CHAT_MAX_TOKENS = 128


def _usage(r: OpenAIRequest) -> bool:
    """Whether a stream ends with a usage chunk."""
    return r.stream_options is not None and r.stream_options.get("include_usage", False)


def parse_completion(body, eos: tuple[int, ...], max_batch: int) -> tuple[list[Job], bool, bool]:
    """(jobs, stream, include_usage) for `/v1/completions`."""
    r = validated(CompletionRequest, body)
    prompt = r.prompt  # a text, token ids, or a batch of either
    batch = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    if len(batch) > max_batch:
        raise BadRequest(f"a batch holds 1 to {max_batch} prompts, got {len(batch)}")
    sampling = make_sampling(r, eos, r.max_tokens, COMPLETION_MAX_TOKENS, r.seed, "", OPENAI_NAMES)
    lp = r.logprobs  # how many alternatives per token (0: the sampled token's alone)
    echo = bool(r.echo)  # the prompt comes back before the completion (with logprobs: its own)
    since = 0 if echo and lp is not None else None
    # `cache_salt` partitions the cache as vLLM's does (a request reuses only prefixes cached under it)
    sid, salt = r.session_id, _salt(None, r.cache_salt)
    jobs = [Job(Request(text=p if type(p) is str else None, input_ids=None if type(p) is str else p,
                        sampling=sampling, session_id=sid, salt=salt, logprobs=lp, prompt_logprobs_from=since),
                sampling.stop, logprobs=lp is not None, echo=echo) for p in batch]
    return jobs, r.stream, _usage(r)


def parse_chat(body, eos: tuple[int, ...]) -> tuple:
    """(messages, sampling, stream, include_usage, session id, salt, logprobs count or
    None) for `/v1/chat/completions`."""
    r = validated(ChatRequest, body)
    # a message with text content is what the template takes as it is
    out = [m if type(m.get("content")) is str else
           {"role": m["role"], "content": "".join(p["text"] for p in m.get("content") or ())} for m in r.messages]
    if r.max_completion_tokens is None:
        sampling = make_sampling(r, eos, r.max_tokens, CHAT_MAX_TOKENS, r.seed, "", OPENAI_NAMES)
    else:
        sampling = make_sampling(r, eos, r.max_completion_tokens, CHAT_MAX_TOKENS, r.seed, "", CHAT_NAMES)
    # `logprobs` true: the output tokens' logprobs, with `top_logprobs` alternatives each
    return (out, sampling, r.stream, _usage(r), r.session_id, _salt(None, r.cache_salt),
            (r.top_logprobs or 0) if r.logprobs else None)


def chat_count_field(body: dict) -> str:
    """Which field a chat request's count of new tokens comes from: OpenAI's newer
    `max_completion_tokens` where given, else the older `max_tokens` (what any message
    about the count names)."""
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
