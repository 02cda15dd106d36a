"""Request bodies in, engine Requests out: SGLang's `/generate` and OpenAI's completions
and chat completions, checked field by field. Anything wrong is a `BadRequest` naming
the field (a 4xx), never an exception from deeper down.

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

from ..engine import Request, SamplingParams
from ..engine.request import MAX_TOP_LOGPROBS
from .compat import (GENERATE_IGNORED, GENERATE_NEUTRAL, GENERATE_USED, SAMPLING_IGNORED, SAMPLING_NEUTRAL,
                     SAMPLING_USED, UNKNOWN, neutral)


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


# ---------------------------------------------------------------------------- field checks
def _int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _num(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def want(cond: bool, name: str, what: str, value) -> None:
    if not cond:
        shown = repr(value)
        raise BadRequest(f"{name} must be {what}, got {shown[:60]}")


def only(name: str, value, allowed) -> None:
    """A field accepted for compatibility at its neutral value only."""
    if value not in allowed:
        raise BadRequest(f"{name}={value!r:.40} is not supported (only {' or '.join(map(repr, allowed))})")


def _ids(name: str, v) -> list[int]:
    want(isinstance(v, list) and all(_int(t) for t in v), name, "a list of token ids (ints)", v)
    return list(v)


def _session(name: str, v):
    want(v is None or (isinstance(v, str) and v) or _int(v), name, "a non-empty string or an int", v)
    return v


#: stop strings a request may give: each is looked for after every token, so a request
#: with thousands of them would slow every other request in its batch
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


def _given(d: dict, key: str, default):
    """d[key], or `default` only when it is absent or null (0 and false are values, and
    are checked as such)."""
    v = d.get(key)
    return default if v is None else v


def _stops(name: str, v, most: int = MAX_STOP_STRINGS) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    want(isinstance(v, list) and all(isinstance(s, str) and s for s in v), name,
         "a non-empty string or a list of them", v)
    if len(v) > most:
        raise BadRequest(f"{name}: at most {most} stop sequences, got {len(v)}")
    if any(len(s) > MAX_STOP_CHARS for s in v):
        raise BadRequest(f"{name}: a stop sequence holds at most {MAX_STOP_CHARS} characters")
    return tuple(v)


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


def _known_fields(where: str, d: dict, used, ignored, neutral_only: dict, prefix: str = "") -> None:
    """Refuse a field that asks for what is not implemented (a 400 naming it); note the
    names SGLang does not know either (ignored, one warning per name)."""
    for k in sorted(d.keys() & neutral_only.keys()):
        if not neutral(d[k], neutral_only[k]):
            shown = " or ".join("null" if a is None else repr(a) for a in neutral_only[k])
            raise BadRequest(f"{prefix}{k}={d[k]!r:.40} is not supported (only {shown})")
    UNKNOWN.note(where, {k for k in d if isinstance(k, str)} - used - ignored - neutral_only.keys())


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
    want(isinstance(body, dict), "the request body", "a JSON object", type(body).__name__)
    _known_fields("/generate", body, GENERATE_USED, GENERATE_IGNORED, GENERATE_NEUTRAL)
    want(body.get("modalities") in (None, []) or (isinstance(body.get("modalities"), list)
                                                  and all(m is None for m in body["modalities"])),
         "modalities", "null or empty (no image, video or audio input is supported)", body.get("modalities"))
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of text or input_ids")
    if text is not None:
        batched = isinstance(text, list)
        prompts = text if batched else [text]
        for i, t in enumerate(prompts):
            want(isinstance(t, str), f"text[{i}]" if batched else "text", "a string", t)
    else:
        want(isinstance(ids, list), "input_ids", "a list of token ids or a list of such lists", ids)
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = [_ids(f"input_ids[{i}]", x) for i, x in enumerate(ids)] if batched else [_ids("input_ids", ids)]
    if batched and not 1 <= len(prompts) <= max_batch:
        raise BadRequest(f"a batch holds 1 to {max_batch} prompts, got {len(prompts)}")
    n = len(prompts)
    sps = _per_prompt("sampling_params", body.get("sampling_params"), n, batched, dict)
    rid = body.get("rid")
    rids = [f"{rid}_{i}" for i in range(n)] if batched and isinstance(rid, str) else \
        _per_prompt("rid", rid, n, batched, str)  # a batch's one rid prefixes its prompts' ids, as SGLang's does
    stream = body.get("stream", False)
    want(isinstance(stream, bool), "stream", "true or false", stream)
    continuation = _continuation(body, batched)
    sid = continuation[0] if continuation else _session("session_id", body.get("session_id"))
    salts = [_salt(e, c) for e, c in zip(_per_prompt("extra_key", body.get("extra_key"), n, batched, str),
                                         _per_prompt("cache_salt", body.get("cache_salt"), n, batched, str))]
    priority = body.get("priority")
    want(priority is None or _int(priority), "priority", "an int", priority)
    want_lp = _per_prompt("return_logprob", body.get("return_logprob"), n, batched, bool)
    tops = _per_prompt("top_logprobs_num", body.get("top_logprobs_num"), n, batched, int)
    starts = _per_prompt("logprob_start_len", body.get("logprob_start_len"), n, batched, int)
    with_text = body.get("return_text_in_logprobs", False)
    want(isinstance(with_text, bool), "return_text_in_logprobs", "true or false", with_text)
    jobs = []
    for i, (p, sp, rid, salt) in enumerate(zip(prompts, sps, rids, salts)):
        prefix = f"sampling_params[{i}]" if batched else "sampling_params"
        sampling, extra = sampling_from_sglang(sp or {}, eos, prefix)
        lp = None if not want_lp[i] else _top_count(f"top_logprobs_num{f'[{i}]' if batched else ''}", tops[i])
        start = starts[i] if lp is not None and starts[i] is not None and starts[i] >= 0 else None
        req = Request(input_ids=None if text is not None else p, text=p if text is not None else None,
                      sampling=sampling, session_id=sid, priority=priority, salt=salt, logprobs=lp,
                      prompt_logprobs_from=start)
        jobs.append(Job(req, sampling.stop, rid=rid, logprobs=lp is not None, text_in_logprobs=with_text,
                        session=continuation, **extra))
    return jobs, batched, stream


SESSION_FIELDS = ("id", "rid", "offset", "replace", "drop_previous_output")


def _continuation(body: dict, batched: bool) -> tuple | None:
    """SGLang's session_params: the server keeps each turn of the session, and this
    request continues turn `rid` (default: the latest) with only its new tokens, after
    that turn's prompt and output (its prompt alone with drop_previous_output), cut at
    `offset`. `replace` (abort a turn and its branches) is refused."""
    sp = body.get("session_params")
    if sp is None:
        return None
    want(isinstance(sp, dict), "session_params", "an object", sp)
    if body.get("session_id") is not None:
        raise BadRequest("give session_id or session_params, not both (as SGLang asks)")
    if batched:
        raise BadRequest("session_params continues one conversation: send one prompt")
    unknown = sorted(set(sp) - set(SESSION_FIELDS))
    if unknown:
        raise BadRequest(f"session_params: unknown field(s) {unknown}; it takes {', '.join(SESSION_FIELDS)}")
    sid = sp.get("id")
    want(isinstance(sid, str) and sid, "session_params.id", "a non-empty string", sid)
    rid = sp.get("rid")
    want(rid is None or (isinstance(rid, str) and rid), "session_params.rid", "a request id (a string)", rid)
    offset = sp.get("offset")
    want(offset is None or (_int(offset) and offset >= 0), "session_params.offset", "an int >= 0", offset)
    drop = sp.get("drop_previous_output")
    want(drop is None or isinstance(drop, bool), "session_params.drop_previous_output", "true or false", drop)
    if sp.get("replace"):
        raise BadRequest("session_params.replace (abort a turn and its branches, then insert this one) is not "
                         "supported; continue from the turn before it with session_params.rid")
    return sid, rid, offset, bool(drop)


def _top_count(name: str, v) -> int:
    want(v is None or (_int(v) and 0 <= v <= MAX_TOP_LOGPROBS), name, f"an int in [0, {MAX_TOP_LOGPROBS}]", v)
    return v or 0


def _per_prompt(name: str, v, n: int, batched: bool, kind) -> list:
    if v is None:
        return [None] * n
    if batched and isinstance(v, list):
        if len(v) != n:
            raise BadRequest(f"{name}: {len(v)} given for {n} prompts")
        for i, x in enumerate(v):
            want(isinstance(x, kind), f"{name}[{i}]", f"a {kind.__name__}", x)
        return list(v)
    want(isinstance(v, kind), name, f"a {kind.__name__}" + (" or a list of them" if batched else ""), v)
    return [v] * n


def sampling_from_sglang(sp: dict, eos: tuple[int, ...], prefix: str) -> tuple[SamplingParams, dict]:
    """SGLang's sampling_params (its defaults: 128 new tokens, temperature 1; the
    default count is shortened to the room the context leaves, a given one is not)."""
    _known_fields("/generate sampling_params", sp, SAMPLING_USED, SAMPLING_IGNORED, SAMPLING_NEUTRAL, f"{prefix}.")
    flags = {}
    for k in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"):
        v = sp.get(k, k in ("skip_special_tokens", "spaces_between_special_tokens"))
        want(isinstance(v, bool), f"{prefix}.{k}", "true or false", v)
        flags[k] = v
    stop_ids = _ids(f"{prefix}.stop_token_ids", _given(sp, "stop_token_ids", []))
    seed = sp.get("seed", sp.get("sampling_seed"))
    count = sp.get("max_new_tokens")
    sampling = make_sampling(prefix, {"stop_ids": "stop_token_ids"},
                             max_new_tokens=GENERATE_MAX_NEW_TOKENS if count is None else count,
                             fit_context=count is None,
                             temperature=sp.get("temperature", 1.0), top_p=sp.get("top_p", 1.0),
                             top_k=sp.get("top_k", -1), seed=seed,
                             stop=_stops(f"{prefix}.stop", sp.get("stop"), MAX_STOP_STRINGS),
                             stop_ids=tuple(stop_ids) + (() if flags["ignore_eos"] else tuple(eos)))
    return sampling, dict(skip_special_tokens=flags["skip_special_tokens"], no_stop_trim=flags["no_stop_trim"])


def make_sampling(prefix: str, names: dict | None = None, **kw) -> SamplingParams:
    if kw.get("top_k") is None:
        kw["top_k"] = -1
    if kw.get("top_p") is None:
        kw["top_p"] = 1.0
    if kw.get("temperature") is None:
        kw["temperature"] = 1.0
    try:
        return SamplingParams(**kw)
    except ValueError as e:  # SamplingParams names the field (by the engine's name)
        msg = str(e)
        for engine_name, api_name in (names or {}).items():
            msg = msg.replace(engine_name, api_name)
        raise BadRequest(f"{prefix}.{msg}" if prefix else msg) from None


# ---------------------------------------------------------------------------- OpenAI
#: new tokens when a request names none: OpenAI's 16 for completions; a chat reply needs
#: more (OpenAI fills the context; 128 is SGLang's native default). Either default is
#: shortened to the room the context leaves after the prompt; a count the client gave
#: is refused (400) if it does not fit
COMPLETION_MAX_TOKENS = 16
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "stop_ids": "stop_token_ids"}
CHAT_MAX_TOKENS = 128


def _openai_sampling(body: dict, eos: tuple[int, ...], max_tokens, default: int,
                     names: dict = OPENAI_NAMES) -> SamplingParams:
    only("n", body.get("n", 1), (1, None))
    only("best_of", body.get("best_of"), (1, None))
    only("logit_bias", body.get("logit_bias"), (None, {}))
    only("suffix", body.get("suffix"), (None, ""))
    for k in ("presence_penalty", "frequency_penalty"):
        only(k, body.get(k, 0), (0, 0.0, None))
    ignore_eos = body.get("ignore_eos", False)
    want(isinstance(ignore_eos, bool), "ignore_eos", "true or false", ignore_eos)
    return make_sampling("", names, max_new_tokens=default if max_tokens is None else max_tokens,
                         fit_context=max_tokens is None, temperature=body.get("temperature"),
                         top_p=body.get("top_p"), top_k=body.get("top_k"), seed=body.get("seed"),
                         stop=_stops("stop", body.get("stop"), 4),
                         stop_ids=tuple(_ids("stop_token_ids", _given(body, "stop_token_ids", [])))
                         + (() if ignore_eos else tuple(eos)))


def _openai_common(body) -> tuple[bool, bool, object, object]:
    """(stream, include_usage, session id, salt): `cache_salt` partitions the cache as
    vLLM's does (a request reuses only prefixes cached under the same salt)."""
    want(isinstance(body, dict), "the request body", "a JSON object", type(body).__name__)
    model = body.get("model")
    want(model is None or isinstance(model, str), "model", "a string", model)
    stream = body.get("stream", False)
    want(isinstance(stream, bool), "stream", "true or false", stream)
    opts = body.get("stream_options") or {}
    want(isinstance(opts, dict), "stream_options", "an object", opts)
    usage = opts.get("include_usage", False)
    want(isinstance(usage, bool), "stream_options.include_usage", "true or false", usage)
    salt = body.get("cache_salt")
    want(salt is None or isinstance(salt, str), "cache_salt", "a string", salt)
    return stream, usage, _session("session_id", body.get("session_id")), _salt(None, salt)


def parse_completion(body, eos: tuple[int, ...], max_batch: int) -> tuple[list[Job], bool, bool]:
    """(jobs, stream, include_usage) for `/v1/completions`."""
    stream, usage, sid, salt = _openai_common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [("text", prompt)]
    elif isinstance(prompt, list) and prompt and all(_int(t) for t in prompt):
        prompts = [("ids", list(prompt))]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [("text", p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [("ids", _ids(f"prompt[{i}]", p)) for i, p in enumerate(prompt)]
    else:
        raise BadRequest(f"prompt must be a string, a list of strings, a list of token ids or a list of such "
                         f"lists, got {prompt!r:.60}")
    if len(prompts) > max_batch:
        raise BadRequest(f"a batch holds 1 to {max_batch} prompts, got {len(prompts)}")
    if stream and len(prompts) > 1:
        raise BadRequest("stream with more than one prompt is not supported")
    max_tokens = body.get("max_tokens")
    sampling = _openai_sampling(body, eos, max_tokens, COMPLETION_MAX_TOKENS)
    k = body.get("logprobs")  # completions: how many alternatives per token (0: the sampled token's alone)
    lp = None if k is None or k is False else _top_count("logprobs", k)
    echo = body.get("echo", False)  # the prompt comes back before the completion (with logprobs: its own)
    want(isinstance(echo, bool) or echo is None, "echo", "true or false", echo)
    if echo and stream:
        raise BadRequest("echo with stream is not supported")
    jobs = [Job(Request(text=p if kind == "text" else None, input_ids=p if kind == "ids" else None,
                        sampling=sampling, session_id=sid, salt=salt, logprobs=lp,
                        prompt_logprobs_from=0 if echo and lp is not None else None), sampling.stop,
                logprobs=lp is not None, echo=bool(echo)) for kind, p in prompts]
    return jobs, stream, usage


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body, eos: tuple[int, ...]) -> tuple:
    """(messages, sampling, stream, include_usage, session id, salt, logprobs count or
    None) for `/v1/chat/completions`."""
    stream, usage, sid, salt = _openai_common(body)
    msgs = body.get("messages")
    want(isinstance(msgs, list) and msgs, "messages", "a non-empty list of messages", msgs)
    out = []
    for i, m in enumerate(msgs):
        want(isinstance(m, dict), f"messages[{i}]", "an object with role and content", m)
        role, content = m.get("role"), m.get("content")
        want(role in CHAT_ROLES, f"messages[{i}].role", f"one of {', '.join(CHAT_ROLES)}", role)
        if isinstance(content, list):  # content parts: text only
            for j, part in enumerate(content):
                want(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str),
                     f"messages[{i}].content[{j}]", 'a {"type": "text", "text": ...} part', part)
            content = "".join(p["text"] for p in content)
        want(isinstance(content, str) or (content is None and role == "assistant"), f"messages[{i}].content",
             "a string or a list of text parts", content)
        out.append({"role": role, "content": content or ""})
    for k in ("tools", "functions"):
        only(k, body.get(k), (None, []))
    only("tool_choice", body.get("tool_choice"), (None, "none", "auto"))
    rf = body.get("response_format")
    if rf is not None:
        want(isinstance(rf, dict) and rf.get("type") == "text", "response_format", '{"type": "text"}', rf)
    field = chat_count_field(body)
    return (out, _openai_sampling(body, eos, body.get(field), CHAT_MAX_TOKENS,
                                  {**OPENAI_NAMES, "max_new_tokens": field}), stream, usage, sid, salt,
            chat_logprobs_count(body))


def chat_logprobs_count(body: dict) -> int | None:
    """Chat's `logprobs` (true: the output tokens' logprobs) and `top_logprobs` (how many
    alternatives, which needs logprobs true): the engine's count, or None."""
    asked = body.get("logprobs")
    want(asked is None or isinstance(asked, bool), "logprobs", "true or false", asked)
    top = body.get("top_logprobs")
    if not asked:
        if top:
            raise BadRequest("top_logprobs needs logprobs: true")
        return None
    return _top_count("top_logprobs", top)


def chat_count_field(body: dict) -> str:
    """Which field a chat request's count of new tokens comes from: OpenAI's newer
    `max_completion_tokens` where given, else the older `max_tokens` (what any message
    about the count names)."""
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
